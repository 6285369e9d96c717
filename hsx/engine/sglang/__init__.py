"""The SGLang engine (the only package that imports sglang): the runner, and hsx's capture in SGLang's scheduler."""
