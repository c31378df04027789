"""specd: keeps an SGLang server's speculative decoding tuned to its traffic."""

__version__ = "0.1.0"
