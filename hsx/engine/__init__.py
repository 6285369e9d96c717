"""Engines that run a model and hand aligned samples to the rest of hsx.

One folder per engine (``hf``: transformers, embedded; ``sglang``; ``vllm``; ``replay``: a run over an
hsx output's tokens), each behind the runner contract of :mod:`hsx.engine.contract` and picked by
name from :mod:`hsx.engine.registry`. ``families`` holds what differs between model families and is
shared by the engines that load a transformers model; no engine imports another.
"""
