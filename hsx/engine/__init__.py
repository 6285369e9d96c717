"""Engines that run a model and hand aligned samples to the rest of hsx."""

from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings, load_hf_engine

__all__ = ["HFEngine", "SamplingSettings", "SpecSettings", "load_hf_engine"]
