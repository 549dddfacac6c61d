# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment:
    """How to reach and log in to the Proxmox VE API (named as community.proxmox names them)."""

    DOCUMENTATION = r"""
options:
  api_host:
    description:
      - Host name or address of the Proxmox VE API (any node of the cluster).
      - If not given, the environment variable E(PROXMOX_HOST) is used.
    type: str
    required: true
  api_port:
    description:
      - Port of the API.
      - If not given, the environment variable E(PROXMOX_PORT) is used, else C(8006).
    type: int
  api_user:
    description:
      - User to log in as, with its realm, for example C(root@pam) or C(ops@pve). With a token,
        the user the token belongs to.
      - If not given, the environment variable E(PROXMOX_USER) is used.
    type: str
    required: true
  api_password:
    description:
      - Password of O(api_user); the module logs in for a ticket and logs in again when the server
        says the ticket has expired.
      - If not given, the environment variable E(PROXMOX_PASSWORD) is used.
      - One of O(api_password) and O(api_token_id) is required.
      - A value with a control character (a newline, a carriage return, a tab), such as the trailing
        newline of a YAML block scalar (C(|)), is refused without being shown; use C(|-).
    type: str
  api_token_id:
    description:
      - Name of an API token of O(api_user) (the part after C(!)), used instead of a password.
      - If not given, the environment variable E(PROXMOX_TOKEN_ID) is used.
    type: str
  api_token_secret:
    description:
      - Secret of the API token O(api_token_id).
      - If not given, the environment variable E(PROXMOX_TOKEN_SECRET) is used.
      - A value with a control character (a newline, a carriage return, a tab), such as the trailing
        newline of a YAML block scalar (C(|)), is refused without being shown; use C(|-). The same
        holds for O(api_host), O(api_user) and O(api_token_id), which go into the request too.
    type: str
  validate_certs:
    description:
      - Whether the server's TLS certificate is verified. Leave it on and give O(ca_path); turning it
        off lets anyone on the path read the credentials.
      - If not given, the environment variable E(PROXMOX_VALIDATE_CERTS) is used.
    type: bool
    default: true
  ca_path:
    description:
      - A PEM file with the CA certificate(s) that signed the API's certificate, for example
        C(/etc/pve/pve-root-ca.pem) copied from a node. Without it the system's CA store is used.
      - If not given, the environment variable E(PROXMOX_CA_PATH) is used.
    type: path
  api_timeout:
    description:
      - Seconds to wait for the answer to one API request. More than 0 and at most 86400 (a day);
        C(0) is refused.
      - Reads that fail for a passing reason (connection error, timeout, HTTP 5xx, 595) are retried
        with backoff. A request that changes something is sent again only when the server certainly
        did not act on it; when that is not certain, the module first looks for the task it would
        have started, for up to this many seconds.
    type: int
    default: 10
requirements:
  - proxmoxer >= 2.0 (on the host that runs the module, usually the controller)
  - requests
"""
