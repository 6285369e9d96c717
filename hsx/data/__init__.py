"""Dataset ingestion: read rows (load) and turn them into token ids and loss masks (render)."""

from hsx.data.load import dataset_fingerprint, describe, load_rows
from hsx.data.render import Prompt, Renderer

__all__ = ["Prompt", "Renderer", "dataset_fingerprint", "describe", "load_rows"]
