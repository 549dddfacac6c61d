"""XID lines in the real kernel log, written by the kernel itself (facility 0), for gpu_health's tests.

User space cannot write a kernel-facility record: the kernel stamps whatever is written to /dev/kmsg with
the user facility, whatever ``<N>`` prefix it carries (that is what makes the kernel log trustworthy,
and what gpu_health relies on). So the kernel is made to write the line: an nftables rule in a table
of this test's own logs one loopback UDP packet with ``log prefix "NVRM: Xid (...)"``, and the kernel's
netfilter log (nf_log_syslog) prints the prefix at the start of a facility-0 record, followed by the
packet's fields. Root only, the init network namespace; the table is removed by its recorded name.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.harness.prometheus import skip_or_fail

# NF_LOG_PREFIXLEN is 128 with its NUL.
MAX_PREFIX = 127
KMSG = "/dev/kmsg"


class KernelXidWriter:
    """Writes XID lines into the kernel log as the kernel's own records, one loopback packet each."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._port = 40000 + os.getpid() % 20000

    def kernel_line(self, text: str) -> None:
        if len(text) > MAX_PREFIX or '"' in text:
            raise ValueError(f"a log prefix is at most {MAX_PREFIX} characters without quotes: {text!r}")
        self._port += 1
        nft("add", "rule", "inet", self.table, "out", "oif", "lo", "udp", "dport", str(self._port),
            "log", "prefix", f'"{text} "', "level", "err")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"x", ("127.0.0.1", self._port))

    @staticmethod
    def user_line(text: str, prefix: str = "") -> None:
        """The same text written from user space (root) to /dev/kmsg: it carries the user facility."""
        with open(KMSG, "w", encoding="utf-8") as kmsg:
            kmsg.write(f"{prefix}{text}\n")


def nft(*arguments: str) -> None:
    subprocess.run(["nft", *arguments], check=True, capture_output=True, text=True)


@contextmanager
def kernel_xids() -> Iterator[KernelXidWriter]:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        skip_or_fail("writing kernel-facility XID lines needs root and nft (the nftables package)")
    table = f"gpuops_xid_{os.getpid()}"
    nft("add", "table", "inet", table)
    try:
        nft("add", "chain", "inet", table, "out", "{ type filter hook output priority 0; policy accept; }")
        yield KernelXidWriter(table)
    finally:
        nft("delete", "table", "inet", table)
