"""Where the installed service lives: unit names, directories and files.

One place for the paths the units, the install plan, uninstall and status
share, so that a rendered unit and the code that reads it back never disagree.
All are system paths, reached through SysRoot.
"""

from __future__ import annotations

import os
import re

from orin.model.store import SYSTEM_MODELS_DIR
from orin.system.statefile import DEFAULT_STATE_PATH, ROOT_STATE_DIR

SERVICE = "orin-llm.service"
TUNE_SERVICE = "orin-llm-tune.service"
UNITS = (TUNE_SERVICE, SERVICE)  # the order they start in

UNIT_DIR = "/etc/systemd/system"
CONF_DIR = "/etc/orin-llm"
ENV_FILE = "/etc/orin-llm/orin-llm.env"
ENV_MODE = "0640"  # root:<the service's group>: the API key, read by the service alone
PROFILE_FILE = "/etc/orin-llm/profile.yaml"
STATE_DIR = "/var/lib/orin-llm"  # the service user's home and StateDirectory
MODELS_DIR = SYSTEM_MODELS_DIR  # root's `model pull` and install's pull put files here
CACHE_DIR = "/var/cache/orin-llm"
# Root's tuning state (0700 root), apart from anything the service user can write.
TUNE_STATE_DIR = ROOT_STATE_DIR
TUNE_STATE_FILE = DEFAULT_STATE_PATH

DEFAULT_USER = "orin-llm"
# useradd's default NAME_REGEX, at most 32 characters: what the User= of a unit and
# useradd/usermod/userdel take as one name (never an option, never two words).
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
GPU_GROUPS = ("video", "render")  # the Jetson GPU nodes belong to these groups

# Homes are hidden from the service (ProtectHome=yes) unless something it must
# read lives under one of these.
HOME_PREFIXES = ("/home/", "/root/", "/run/user/")


# systemd.unit(5), "System Unit Search Path": the folders an administrator puts unit
# files in (Debian's /lib/systemd/system too), where `systemctl enable` finds them
UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)


def check_unit_dir(path: str) -> str:
    """A ``--unit-dir`` systemd loads units from (without a trailing ``/``). A ValueError
    says why not: a unit written anywhere else is not found by `systemctl enable`, and a
    relative path would be taken from wherever the command runs."""
    folder = os.path.normpath(path) if path.startswith("/") else path
    if folder not in UNIT_DIRS:
        raise ValueError(
            f"{path}: not a folder systemd loads units from; give one of {', '.join(UNIT_DIRS)}"
        )
    return folder


def check_service_user(name: str) -> str:
    """A ``--user`` the units may run as: a system user name, and not root (the
    hardening would be for nothing, and ``uninstall --purge`` removes the user).
    A ValueError says why not."""
    if name == "root":
        raise ValueError(
            "root: the service runs as a user of its own (the default, "
            f"{DEFAULT_USER}, is created when missing)"
        )
    if not _USER_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a user name: lower-case letters, digits, '_' and '-', "
            "starting with a letter or '_', at most 32 characters"
        )
    return name


def env_values(text: str) -> dict[str, str]:
    """The variables an environment file (``ENV_FILE``, systemd's EnvironmentFile)
    sets: comments skipped, quotes around a value removed, the last assignment wins."""
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("\"'")
    return values


def unit_path(unit_dir: str, unit: str) -> str:
    return f"{unit_dir.rstrip('/')}/{unit}"
