"""Imported by the fork server the ranks are started from, before it forks any (bench/supervisor.py
names it in ``set_forkserver_preload``, after torch); not meant to be imported elsewhere.

The server is Python's own (``multiprocessing.forkserver``). It ends when the launcher has
gone, even by SIGKILL, and Linux then ends its ranks (torch asked it to). As it ends, it
removes the folder of its socket, which the launcher would have removed on its way out, so a
killed run leaves no temporary file; then it leaves without the interpreter's teardown, which
costs a second of CPU with torch loaded while whoever reads the run's output waits for it (the
server holds the launcher's stdout and stderr).
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
