"""Exception types. Horovod's names (`HorovodInternalError`, ...) are the same classes, so code
that catches Horovod's exceptions catches ferrovod's."""


class FerrovodError(RuntimeError):
    """Base of ferrovod's runtime errors."""


class HorovodInternalError(FerrovodError):
    """A collective failed or the job is shutting down; Horovod's elastic mode restores state."""


class ShutDownError(HorovodInternalError):
    """ferrovod has shut down (this rank or another one); pending operations fail with it."""


class PreconditionError(HorovodInternalError):
    """Ranks disagreed about a tensor (dtype, shape, op, root, ...); raised on every rank."""


class InvalidArgumentError(ValueError):
    """A call was rejected before anything was enqueued (bad argument, duplicate name, ...)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic mode: the set of hosts changed."""

    def __init__(self, skip_sync=False):
        super().__init__()
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """A framework extension was built against another framework version."""

    def __init__(self, name, version, installed_version):
        super().__init__(
            "Framework %s installed with version %s but found version %s. Reinstall ferrovod "
            "(`pip install --no-cache-dir .`) to rebuild against the installed framework."
            % (name, installed_version, version)
        )
        self.name = name
        self.version = version
        self.installed_version = installed_version
