"""Imported by the fork server the ranks are started from, before it forks any (common/launch.py
names it, beside torch, in ``set_forkserver_preload``); not meant to be imported elsewhere.

The server is Python's own (``multiprocessing.forkserver``): it ends when the launcher has
gone, even by SIGKILL, and Linux then ends the ranks (torch asked it to). What the launcher
would have removed on its way out, the folder of the server's socket, the server removes as it
ends, so a killed run leaves no temporary file.
"""

import atexit
import multiprocessing.forkserver
import os
import shutil


def _remove_socket_folder() -> None:
    address = multiprocessing.forkserver._forkserver._forkserver_address  # set by the server
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


atexit.register(_remove_socket_folder)
