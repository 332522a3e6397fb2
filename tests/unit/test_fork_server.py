"""tests/fork_server.py: its stand-in for `python` behaves, to the script that calls it, as the
interpreter it replaces: arguments, working folder, environment, stdin and stdout, sys.path's first
entry, the exit status and death by a signal, a module run with -m; and each command is a fork."""

from __future__ import annotations

import os
import textwrap

from tests.fork_server import ForkServer

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    line = sys.stdin.readline().strip()
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "stdin": line,
                      "variable": os.environ.get("FORK_SERVER_VARIABLE"), "pid": os.getpid(),
                      "ppid": os.getppid(), "lightning": "lightning" in sys.modules}))
    print("on stderr", file=sys.stderr)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    if sys.argv[1] == "kill":  # SIGKILL: its stand-in cannot reset a handler for it, and dies of it all the same
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else "a message")
""")


def test_the_stand_in_is_the_interpreter_to_its_caller(tmp_path):
    import json

    (tmp_path / "tool").mkdir()
    script = tmp_path / "tool" / "probe.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    shell = (f'cd {work} && for arg in 3 signal kill text; do echo "in-$arg" | "$PYTHON" {script} $arg; echo "status $?"; '
             'done; "$PYTHON" -m json.tool --compact <<< \'{"a": [1, 2]}\'; echo "status $?"')
    env = {**os.environ, "FORK_SERVER_VARIABLE": "seen"}
    with ForkServer() as server:
        env["PYTHON"] = str(server.python)
        done = server.run(["bash", "-c", shell], timeout=120, env=env)
        assert server.served == 5
    lines = done.stdout.splitlines()
    records = [json.loads(line) for line in lines if line.startswith('{"argv"')]
    assert [line for line in lines if line.startswith("status")] == ["status 3", "status 143", "status 137", "status 1", "status 0"], \
        done.stderr[-3000:]
    assert '{"a":[1,2]}' in lines  # -m json.tool read its stdin and wrote to the caller's stdout
    assert done.stderr.count("on stderr") == 4 and "a message" in done.stderr
    for record, arg in zip(records, ("3", "signal", "kill", "text")):
        assert record["argv"] == [str(script), arg] and record["stdin"] == f"in-{arg}"
        assert record["cwd"] == str(work) and record["path0"] == str(script.parent)
        assert record["variable"] == "seen" and record["lightning"]  # inherited from this process: a fork
        assert record["ppid"] == os.getpid()
