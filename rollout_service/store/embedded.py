"""A private redis-server for the single-machine ``up`` command and for tests.

On one machine the service still needs a real Redis: Ray actors in different processes must share
rollout state, which no in-process fake can do. This starts the apt-installed ``redis-server`` on
127.0.0.1 with an append-only file (so a restart keeps every rollout) and no RDB snapshots (which
would fork a 2-core box for nothing), and stops exactly the process it started. The server also
gets SIGTERM from the kernel when the process that started it dies, even by SIGKILL, so it cannot
outlive its owner. ``supervise()`` (what ``up`` uses) restarts a server that died without being
stopped — killed, OOM-killed, crashed — on the same port and data directory: the AOF is replayed,
so every acknowledged turn is back (Redis writes the AOF before it answers; ``appendfsync
everysec`` only risks the last second on a machine crash, not on a process death), and the
service's clients reconnect on their next call.

Memory is capped (``maxmemory``, policy ``noeviction``): a full server refuses writes — the service
answers 507 and no stored history changes — instead of growing until the machine swaps or the OOM
killer ends it (and every rollout with it). The cap is ``maxmemory`` if given, else the environment
variable ``ROLLOUT_SERVICE_REDIS_MAXMEMORY`` (Redis units: ``4gb``, ``512mb``; ``0`` = no cap), else
a quarter of this machine's RAM (``DEFAULT_MAXMEMORY_FRACTION``). What a rollout takes per token and
per turn: docs/deployment.md, "Redis sizing".
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

INSTALL_HINT = "redis-server not found on PATH: install it with `apt-get install -y redis-server`"
MAXMEMORY_ENV = "ROLLOUT_SERVICE_REDIS_MAXMEMORY"
DEFAULT_MAXMEMORY_FRACTION = 0.25  # of physical RAM: room for Ray, the engines and the OS beside it
MIN_DEFAULT_MAXMEMORY = 256 * 1024 * 1024


class EmbeddedRedisError(RuntimeError):
    pass


def find_redis_server(explicit: str | None = None) -> str:
    path = explicit or shutil.which("redis-server")
    if not path or not os.access(path, os.X_OK):
        raise EmbeddedRedisError(INSTALL_HINT)
    return path


def default_maxmemory() -> str:
    """``maxmemory`` when none is given: the environment's, else a quarter of physical RAM (bytes)."""
    env = os.environ.get(MAXMEMORY_ENV, "").strip()
    if env:
        return env
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "0"  # unknown RAM: no cap rather than a wrong one
    return str(max(MIN_DEFAULT_MAXMEMORY, int(ram * DEFAULT_MAXMEMORY_FRACTION)))


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ping_port(host: str, port: int, timeout: float = 0.2) -> bool:
    """Raw RESP PING, so readiness needs no client library and no event loop."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def _parent_death_signal(sig: int):
    """A ``preexec_fn`` asking the kernel to send ``sig`` to the child when its parent dies (Linux).

    ``prctl`` is looked up here, in the parent, so the forked child only makes the call. If the
    parent died between ``fork`` and ``prctl`` the child is already orphaned and exits at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent, sig = os.getpid(), int(sig)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def popen_tied_to_this_process(args: Sequence[str], **kwargs) -> subprocess.Popen:
    """``Popen(args)`` whose child gets SIGTERM when this process dies, however it dies.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. So the
    fork happens in a daemon thread that then just waits for the child: it lives exactly as long
    as the server should (until the child exits, or this whole process dies), whatever thread
    (an executor's worker, a short-lived helper) calls ``start()``.
    """
    started: dict[str, object] = {}
    ready = threading.Event()

    def spawn_and_wait() -> None:
        try:
            proc = subprocess.Popen(args, preexec_fn=_parent_death_signal(signal.SIGTERM), **kwargs)
        except BaseException as exc:  # handed to the caller
            started["error"] = exc
            ready.set()
            return
        started["proc"] = proc
        ready.set()
        proc.wait()

    threading.Thread(target=spawn_and_wait, name=f"{os.path.basename(args[0])}-owner", daemon=True).start()
    ready.wait()
    if "error" in started:
        raise started["error"]  # type: ignore[misc]
    return started["proc"]  # type: ignore[return-value]


class EmbeddedRedis:
    """One redis-server child process with its data in ``directory``.

    ``start()`` returns the URL; ``stop()`` sends SIGTERM (Redis flushes the AOF on a clean shutdown),
    waits, then SIGKILLs. ``restart()`` keeps port and directory, so the URL stays valid and the AOF is
    replayed. Also a context manager. A stop is registered with ``atexit`` so an interrupted test run
    or CLI does not leave an orphan server behind, and the kernel sends the server SIGTERM (its
    clean shutdown) when this process dies without running atexit (SIGKILL, abort). The server
    runs in its own session, so a Ctrl-C to the terminal's process group does not reach it before
    the orderly stop has flushed the AOF. ``supervise()`` restarts it whenever it dies unasked.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        maxmemory: str | int | None = None,
        extra_args: Sequence[str] = (),
        redis_server: str | None = None,
        ready_timeout: float = 10.0,
    ):
        """``maxmemory``: Redis's cap (bytes, or Redis units such as ``"4gb"``; 0 = none); None: the
        module's default (``ROLLOUT_SERVICE_REDIS_MAXMEMORY``, else a quarter of RAM)."""
        self.directory = Path(directory)
        self.host = host
        self.port = port
        self.maxmemory = str(default_maxmemory() if maxmemory is None else maxmemory)
        self.extra_args = list(extra_args)
        self.redis_server = redis_server
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self._atexit_registered = False
        self._lock = threading.Lock()  # start / stop / a supervised restart, one at a time
        self._stop_requested = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise EmbeddedRedisError("server not started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def log_path(self) -> Path:
        return self.directory / "redis-server.log"

    def start(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        binary = find_redis_server(self.redis_server)
        self.directory.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port is not None
        last_error = ""
        for _ in range(1 if fixed_port else 5):  # a free port can be taken between probe and bind
            port = self.port if fixed_port else free_port(self.host)
            if self._spawn(binary, port):
                self.port = port
                if not self._atexit_registered:
                    atexit.register(self.stop)
                    self._atexit_registered = True
                return self.url
            last_error = self._log_tail()
        raise EmbeddedRedisError(f"redis-server did not become ready: {last_error}")

    def _spawn(self, binary: str, port: int) -> bool:
        args = [
            binary,
            "--bind", self.host,
            "--port", str(port),
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", "",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "noeviction",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as logf:
            self.process = popen_tied_to_this_process(
                args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                return False
            if ping_port(self.host, port):
                return True
            time.sleep(0.01)
        self._terminate()
        return False

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        self._stop_requested.set()  # ends supervision: this exit is asked for
        with self._lock:
            self._terminate(timeout)

    def supervise(self, log=print, interval_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        """Watch the server from a daemon thread until ``stop()``: when it has exited without being
        stopped, start it again on the same port and directory (its AOF replayed), retrying with
        backoff while that fails (the port taken meanwhile, the disk full), each attempt logged."""
        if self._supervisor is not None and self._supervisor.is_alive():
            return
        self._stop_requested.clear()

        def watch() -> None:
            wait = interval_s
            while not self._stop_requested.wait(wait):
                with self._lock:
                    proc = self.process
                    if self._stop_requested.is_set() or (proc is not None and proc.poll() is None):
                        wait = interval_s
                        continue
                    code = proc.returncode if proc is not None else "a failed restart"
                    log(f"[redis] redis-server on {self.host}:{self.port} exited ({code}) without being "
                        f"stopped: restarting it on the same port and data (AOF)")
                    self.process = None
                    try:
                        self.start()
                    except Exception as exc:  # retried: the service answers 503 (rollout store unavailable) meanwhile
                        wait = min(max(wait, interval_s) * 2, max_backoff_s)
                        log(f"[redis] restart failed ({exc}); next attempt in {wait:.0f} s")
                        continue
                    self.restarts += 1
                    wait = interval_s
                    log(f"[redis] redis-server restarted (pid {self.pid}); its clients reconnect on their next call")

        self._supervisor = threading.Thread(target=watch, name="redis-supervisor", daemon=True)
        self._supervisor.start()

    def _terminate(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def restart(self) -> str:
        """Stop and start again (same port and data); supervision, if on, stays on."""
        with self._lock:
            self._terminate()
            return self.start()

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def embedded_redis(directory: str | os.PathLike, **kwargs) -> Iterator[EmbeddedRedis]:
    """For a pytest session fixture: ``with embedded_redis(tmp_path_factory.mktemp("redis")) as r: yield r.url``."""
    server = EmbeddedRedis(directory, **kwargs)
    with server:
        yield server

