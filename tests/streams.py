"""The suite as two streams side by side (``scripts/test.sh``: ``pytest -n 2``, pytest-xdist): the
tests of the session service in one worker, all the others (no cluster, a cluster of their own, the
fleet rigs, the refit controllers) in the other. Each worker starts only the session fixtures its
own stream uses, so none starts twice, and each stream keeps the run order of ``conftest.run_order``
(its heavy fixtures released after their last user). Without ``-n`` one process runs both in turn.

Which stream a test belongs to depends on its fixtures, which only a worker's collection knows: each
worker writes ``{node id: stream}`` to a file the controller named, before it reports its collection;
the controller's scheduler (``StreamScheduling``) reads it and sends each stream, whole and in
order, to one worker. (pytest-xdist's own ``--dist loadgroup`` would do this from an ``xdist_group``
mark, but it renames node ids through an attribute pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

SERVICE, REST = "service", "rest"
STREAMS_FILE = "rollout_service_streams"  # the key in each worker's workerinput
PATH = pytest.StashKey[str]()  # the controller's: the file the workers write


def stream(item) -> str:
    return SERVICE if "service" in getattr(item, "fixturenames", ()) else REST


@pytest.hookimpl(trylast=True)  # after conftest's run order and marks
def pytest_collection_modifyitems(config, items):
    path = getattr(config, "workerinput", {}).get(STREAMS_FILE)
    if path:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({item.nodeid: stream(item) for item in items}, f)
        os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    config = node.config
    if PATH not in config.stash:
        fd, config.stash[PATH] = tempfile.mkstemp(prefix="pytest-streams-", suffix=".json")
        os.close(fd)
    node.workerinput[STREAMS_FILE] = config.stash[PATH]


def pytest_unconfigure(config):
    path = config.stash.get(PATH, None)
    if path and os.path.exists(path):
        os.unlink(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class StreamScheduling(LoadScopeScheduling):
        """LoadScopeScheduling whose scopes are the streams: a stream is one unit of work, sent
        whole, in collection order, to one worker."""

        streams: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.streams is None:
                with open(config.stash[PATH]) as f:
                    self.streams = json.load(f)
            return self.streams.get(nodeid, REST)

    return StreamScheduling(config, log)
