"""`horovod.runner.util.threads` helpers used by Horovod's tests and scripts."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs `target(*args)` on a new (daemon) thread and returns the thread."""

    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
