"""The container engine the image tests use, and their skip mark where none is."""

import pytest

from deploy.image.engine import detect

ENGINE = detect()
needs_engine = pytest.mark.skipif(
    ENGINE is None, reason="neither docker (with a running daemon) nor podman is installed: "
    "`make test` installs podman, runc and debootstrap where it runs as root on Debian")
