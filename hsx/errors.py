"""The one error class hsx raises for conditions a user can fix, and its specialisations."""


class HsxError(Exception):
    """A user-facing failure: the message says what was wrong and where."""


class AlignmentError(HsxError):
    """Hidden-state rows do not line up with the tokens they are supposed to describe."""


class ShardError(HsxError):
    """A shard or manifest is missing, corrupt or inconsistent."""


class SampleError(HsxError):
    """One input sample cannot be processed; the run records it and goes on."""

    def __init__(self, sample_id: str, reason: str):
        super().__init__(f"sample {sample_id!r}: {reason}")
        self.sample_id = sample_id
        self.reason = reason
