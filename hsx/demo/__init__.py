"""Tiny local stand-ins for real models and tokenizers, so hsx runs end to end without downloads."""
