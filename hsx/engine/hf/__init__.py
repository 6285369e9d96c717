"""The transformers engine: batched prefill, plain and speculative (chain/tree) decoding over a cache of its own."""

from hsx.engine.hf.engine import HFEngine, SamplingSettings, SpecSettings, load_hf_engine

__all__ = ["HFEngine", "SamplingSettings", "SpecSettings", "load_hf_engine"]
