"""The board: every /proc, /sys and /etc read goes through SysRoot."""
