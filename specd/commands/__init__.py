"""One thin module per `specd COMMAND`: arguments in, a call into the layers below, text out."""
