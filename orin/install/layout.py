"""Where the installed service lives: unit names, directories and files.

One place for the paths the units, the install plan, uninstall and status
share, so that a rendered unit and the code that reads it back never disagree.
All are system paths, reached through SysRoot.
"""

from __future__ import annotations

from orin.model.store import SYSTEM_MODELS_DIR
from orin.system.statefile import DEFAULT_STATE_PATH, ROOT_STATE_DIR

SERVICE = "orin-llm.service"
TUNE_SERVICE = "orin-llm-tune.service"
UNITS = (TUNE_SERVICE, SERVICE)  # the order they start in

UNIT_DIR = "/etc/systemd/system"
CONF_DIR = "/etc/orin-llm"
ENV_FILE = "/etc/orin-llm/orin-llm.env"
PROFILE_FILE = "/etc/orin-llm/profile.yaml"
STATE_DIR = "/var/lib/orin-llm"  # the service user's home and StateDirectory
MODELS_DIR = SYSTEM_MODELS_DIR  # root's `model pull` and install's pull put files here
CACHE_DIR = "/var/cache/orin-llm"
# Root's tuning state (0700 root), apart from anything the service user can write.
TUNE_STATE_DIR = ROOT_STATE_DIR
TUNE_STATE_FILE = DEFAULT_STATE_PATH

DEFAULT_USER = "orin-llm"
GPU_GROUPS = ("video", "render")  # the Jetson GPU nodes belong to these groups

# Homes are hidden from the service (ProtectHome=yes) unless something it must
# read lives under one of these.
HOME_PREFIXES = ("/home/", "/root/", "/run/user/")


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
