"""A run over an hsx output's tokens: the configured engine's prefill, checked against the source's rows."""
