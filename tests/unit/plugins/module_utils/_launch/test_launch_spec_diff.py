"""_launch/spec_diff.py: what --diff shows of a changed spec - the differing fields only, escaped, secrets masked."""

from __future__ import annotations

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec_diff import spec_diff, spec_fields

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "USER": "root", "LOGNAME": "root", "LANG": "C.UTF-8"}


def launch(**changes) -> dict:
    recorded = {"run_id": "r1", "argv": ["python3", "train.py", "--lr", "0.1"], "env": dict(BASE_ENV),
                "chdir": "/srv/job", "user": None, "group": None, "log_path": "/var/log/train.log", "spec_hash": "h"}
    recorded.update(changes)
    return recorded


def diff_of(before: dict | None, after: dict, before_backend: str | None = "supervisor", after_backend: str = "supervisor"):
    return spec_diff(spec_fields(before, before_backend), spec_fields(after, after_backend), "recorded", "this task")


def test_only_the_fields_that_differ_are_shown_one_line_each() -> None:
    diff = diff_of(launch(), launch(argv=["python3", "train.py", "--lr", "0.05"], log_path="/data/train.log"))
    assert diff["before"] == "command: python3 train.py --lr 0.1\nlog_path: /var/log/train.log\n"
    assert diff["after"] == "command: python3 train.py --lr 0.05\nlog_path: /data/train.log\n"
    assert (diff["before_header"], diff["after_header"]) == ("recorded", "this task")


def test_the_same_spec_shows_nothing() -> None:
    expected = {"before": "", "after": "", "before_header": "recorded", "after_header": "this task"}
    assert diff_of(launch(), launch(run_id="r2")) == expected


def test_env_keys_added_removed_and_changed_come_after_the_command() -> None:
    before = launch(env={**BASE_ENV, "OMP_NUM_THREADS": "4", "OLD": "x"})
    after = launch(argv=["python3", "eval.py"], env={**BASE_ENV, "OMP_NUM_THREADS": "8", "NEW": "y"}, user="train")
    diff = diff_of(before, after)
    assert diff["before"] == "command: python3 train.py --lr 0.1\nenv.OLD: x\nenv.OMP_NUM_THREADS: 4\n"
    assert diff["after"] == "command: python3 eval.py\nenv.NEW: y\nenv.OMP_NUM_THREADS: 8\nuser: train\n"


def test_secret_looking_env_values_are_masked_and_only_said_to_change() -> None:
    before = launch(env={**BASE_ENV, "WANDB_API_KEY": "k-old", "HF_TOKEN": "t", "DB_PASSWORD": "p", "aws_secret": "s"})
    after = launch(env={**BASE_ENV, "WANDB_API_KEY": "k-new", "HF_TOKEN": "t", "DB_PASSWORD": "p2", "ssh_passwd": "q"})
    diff = diff_of(before, after)
    assert diff["before"] == "env.DB_PASSWORD: ********\nenv.WANDB_API_KEY: ********\nenv.aws_secret: ********\n"
    assert diff["after"] == ("env.DB_PASSWORD: ******** (changed)\nenv.WANDB_API_KEY: ******** (changed)\n"
                             "env.ssh_passwd: ********\n")
    for secret in ("k-old", "k-new", "p2", "q", "s"):
        assert f": {secret}\n" not in diff["before"] + diff["after"]


def test_control_characters_are_escaped_in_values_and_keys() -> None:
    after = launch(argv=["python3", "train.py", "--tag", "\x1b]0;pwned\x07"], env={**BASE_ENV, "X\x1b[2J": "a\nb\x9b"})
    diff = diff_of(launch(), after)
    assert "\x1b" not in diff["after"] and "\x07" not in diff["after"] and "\x9b" not in diff["after"]
    assert diff["after"] == ("command: python3 train.py --tag '\\x1b]0;pwned\\x07'\n"
                             "env.X\\x1b[2J: a\\x0ab\\x9b\n")


def test_a_first_start_has_an_empty_before_and_every_set_field_after() -> None:
    diff = diff_of(None, launch(), before_backend=None)
    assert diff["before"] == ""
    assert diff["after"] == ("command: python3 train.py --lr 0.1\n"
                             + "".join(f"env.{key}: {value}\n" for key, value in sorted(BASE_ENV.items()))
                             + "chdir: /srv/job\nlog_path: /var/log/train.log\nbackend: supervisor\n")


def test_another_backend_is_shown() -> None:
    diff = diff_of(launch(), launch(), before_backend="supervisor", after_backend="systemd")
    assert (diff["before"], diff["after"]) == ("backend: supervisor\n", "backend: systemd\n")
