"""Imported by the fork server the ranks are forked from (bench/supervisor.py preloads it),
not elsewhere. The server (``multiprocessing.forkserver``) ends when the launcher has gone, even
by SIGKILL; then it removes its socket's folder, which the launcher would have removed, and
leaves without the interpreter's teardown (a second of CPU with torch loaded, while whoever
reads the run's output waits: the server holds the launcher's stdout and stderr).
"""

import atexit
import multiprocessing.forkserver
import os
import shutil


def _leave() -> None:
    address = multiprocessing.forkserver._forkserver._forkserver_address  # set by the server
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)
    os._exit(0)


atexit.register(_leave)  # run first: atexit runs the last registered first
