"""Processes killed mid-way: one fresh Python runs a prelude once, then forks a child for each of several scripts;
each child is meant to die by SIGKILL (``os.kill(os.getpid(), signal.SIGKILL)`` at some point of its script)."""

from __future__ import annotations

import json
import subprocess
import sys

_RUNNER = """
import json, os, sys
exec(compile({prelude!r}, "<prelude>", "exec"))
codes = []
for script in json.loads({scripts!r}):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: runs the script, which should kill it; a script that returns exits with 0
        try:
            exec(compile(script, "<script>", "exec"))
        except BaseException:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)
    status = os.waitpid(pid, 0)[1]
    codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
print("RESULT=" + json.dumps(codes))
"""


def killed_runs(prelude: str, scripts: list[str], **run) -> tuple[list[int], str]:
    """Each script's return code as ``subprocess`` gives it (-9: killed by SIGKILL), run in a child forked from one
    process after ``prelude`` (imports, a loaded model): each child starts from the same state, as separate
    processes that ran the prelude would; and the end of what they all wrote to stderr. ``run``: subprocess.run's
    arguments (``env``, ``cwd``)."""
    runner = _RUNNER.format(prelude=prelude, scripts=json.dumps(scripts))
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=300, **run)
    assert done.returncode == 0 and "RESULT=" in done.stdout, done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT=")[-1]), done.stderr[-4000:]
