"""One server container, started as users start TGI's image (`run -d -p
…:80 -v …:/data IMAGE FLAGS`) and watched from outside it, for the image
test and `make bench BENCH=image`."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from .engine import Engine


@dataclass
class Container:
    """A detached container of the server; its port 80 published on
    127.0.0.1:`port`. Removed (forcibly) on leaving a `with` block."""

    engine: Engine
    name: str
    port: int

    @classmethod
    def start(cls, engine: Engine, image: str, flags: list[str], port: int, *, env: dict[str, str] | None = None,
              mounts: list[str] = (), user: str | None = None) -> Container:
        """`engine run -d` IMAGE with launcher FLAGS, published on PORT (the
        caller's free port: benchmarks.http.free_port); MOUNTS as `-v` values."""
        name = f"tgi-py-{uuid.uuid4().hex[:10]}"
        args = ["run", "-d", "--name", name, *engine.run_flags, "-p", f"127.0.0.1:{port}:80"]
        for mount in mounts:
            args += ["-v", mount]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        if user is not None:
            args += ["--user", user]
        engine(*args, image, *flags, timeout=120)
        return cls(engine, name, port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> int | None:
        """/health's status, None while nothing answers."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, urllib.error.URLError):
            return None

    def wait_healthy(self, timeout: float = 300) -> float:
        """Seconds until /health answers 200. Raises RuntimeError (with the
        container's log) if it exits first or the timeout passes."""
        start = checked = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.health() == 200:
                return time.monotonic() - start
            # Whether it still runs, once a second: an `inspect` costs the
            # engine ~40 ms of CPU, which ten a second took from the server
            # starting beside it on a small host.
            if time.monotonic() - checked >= 1.0:
                if not self.state().get("Running", False):
                    raise RuntimeError(f"container {self.name} exited before it was healthy:\n{self.logs()[-4000:]}")
                checked = time.monotonic()
            time.sleep(0.1)
        raise RuntimeError(f"container {self.name} not healthy in {timeout:.0f} s:\n{self.logs()[-4000:]}")

    def state(self) -> dict:
        out = self.engine("inspect", "--format", "{{json .State}}", self.name, check=False, timeout=60).stdout
        return json.loads(out) if out.strip() else {}

    def logs(self) -> str:
        done = self.engine("logs", self.name, check=False, timeout=60)
        return done.stdout + done.stderr

    def exec(self, *command: str) -> int:
        return self.engine("exec", self.name, *command, check=False, timeout=60).returncode

    def stop(self, timeout: int = 60) -> int:
        """SIGTERM, then SIGKILL after TIMEOUT seconds; returns the exit code."""
        self.engine("stop", "-t", str(timeout), self.name, timeout=timeout + 60)
        return int(self.state()["ExitCode"])

    def remove(self) -> None:
        self.engine("rm", "-f", self.name, check=False, timeout=120)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
