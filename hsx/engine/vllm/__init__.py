"""The vLLM engine (the only package that imports vllm): the runner, and hsx's capture in vLLM's worker."""
