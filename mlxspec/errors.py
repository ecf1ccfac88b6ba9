"""User-facing errors: each carries a one-line message the CLI prints without a traceback."""


class MlxspecError(Exception):
    """Base class: ``str(err)`` is a complete one-line message for the user."""

    exit_code = 1


class ModelNotFoundError(MlxspecError):
    pass


class InvalidCheckpointError(MlxspecError):
    pass


class DrafterError(MlxspecError):
    """A drafter cannot be used with this target (mismatched vocabulary, missing head...)."""


class RankError(MlxspecError):
    """The processes of a sharded run (mlx.launch) no longer agree, or one of them is gone."""


class UsageError(MlxspecError):
    exit_code = 2
