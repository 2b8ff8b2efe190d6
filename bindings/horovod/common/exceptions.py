"""Horovod's exception types (the same classes ferrovod raises)."""

from ferrovod.exceptions import (  # noqa: F401
    HorovodInternalError,
    HorovodVersionMismatchError,
    HostsUpdatedInterrupt,
)


def get_version_mismatch_message(name, version, installed_version):
    return (
        "Framework %s installed with version %s but found version %s." % (name, installed_version, version)
        + " This can result in unexpected behavior including runtime errors."
        + " Reinstall ferrovod using `pip install --no-cache-dir .` to build with the new version."
    )
