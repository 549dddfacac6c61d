"""Offline stand-in for ansible-test's get-pip bootstrap script.

ansible-test downloads get-pip.py from ci-files.testing.ansible.com to put pip into the
virtual environments it creates; that host is not reachable from our machines. This file is
copied to the cache path ansible-test checks first. It bootstraps pip with ensurepip and then
installs what ansible-test asked for (e.g. ``pip==24.2``) from the configured index.
"""

import ensurepip
import os
import subprocess
import sys

UNSUPPORTED = {"--no-setuptools", "--no-wheel"}

saved_config = os.environ.get("PIP_CONFIG_FILE")
ensurepip.bootstrap(upgrade=True)
# ensurepip points PIP_CONFIG_FILE at /dev/null for its own offline install; the real install
# below must see the machine's pip configuration (index, certificates) again.
if saved_config is None:
    os.environ.pop("PIP_CONFIG_FILE", None)
else:
    os.environ["PIP_CONFIG_FILE"] = saved_config
args = [arg for arg in sys.argv[1:] if arg not in UNSUPPORTED]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
