"""`specd install` / `specd uninstall`: wiring an existing SGLang unit to specd."""
