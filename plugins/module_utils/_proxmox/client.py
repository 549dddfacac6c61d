# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one Proxmox VE API client of this collection, on top of proxmoxer.

It adds what a module that changes things needs and proxmoxer leaves to its caller: connection
options named as community.proxmox names them (so inventories and AWX credentials carry over),
certificate checks on by default, retries with backoff for reads, a fresh ticket when the server
says the old one expired, and errors that say what went wrong in PVE's own words.

A POST is never repeated blindly. It is repeated only when the server certainly did not act on
it (the connection was never made, the server answered 401 or refused with a transient 500 such as
"no quorum"). When the outcome is unknown (the connection broke after the request went out, a
proxy answered 5xx) it raises AmbiguousPost and the caller reads the state before deciding.
"""

from __future__ import annotations

import json
import os
import re
import traceback
import unicodedata
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Mapping
from urllib.parse import quote, quote_plus

from ansible.module_utils.basic import env_fallback

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_seconds
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import backoff, pause

PROXMOXER_IMPORT_ERROR: str | None
try:
    import requests
    from proxmoxer import AuthenticationError, ProxmoxAPI, ResourceException
except ImportError:
    PROXMOXER_IMPORT_ERROR = traceback.format_exc()
    HAS_PROXMOXER = False
else:
    PROXMOXER_IMPORT_ERROR = None
    HAS_PROXMOXER = True

DEFAULT_PORT = 8006

# 500s that PVE answers before it forks a worker and that pass with time: nothing was done, so
# the same POST may be sent again after a pause.
TRANSIENT_REFUSALS = ("no quorum", "got timeout")
# 500s on reads that no retry changes (PVE answers 500 for a guest or node that is not there).
PERMANENT_READ_ERRORS = ("does not exist", "hostname lookup")
# Answered by pveproxy or a proxy in front of it, not by the API handler: the request may or may
# not have reached the node (595-599 are AnyEvent's connection errors, as PVE passes them on).
PROXY_STATUSES = frozenset((502, 503, 504, 595, 596, 597, 598, 599))
DEFAULT_API_TIMEOUT = 10
# What stands in for a secret in a message.
REDACTED = "********"


def proxmox_connection_spec() -> dict[str, dict[str, Any]]:
    """The connection options, as community.proxmox names them, with their environment fallbacks."""
    return {
        "api_host": {"type": "str", "required": True, "fallback": (env_fallback, ["PROXMOX_HOST"])},
        "api_port": {"type": "int", "fallback": (env_fallback, ["PROXMOX_PORT"])},
        "api_user": {"type": "str", "required": True, "fallback": (env_fallback, ["PROXMOX_USER"])},
        "api_password": {"type": "str", "no_log": True, "fallback": (env_fallback, ["PROXMOX_PASSWORD"])},
        "api_token_id": {"type": "str", "no_log": False, "fallback": (env_fallback, ["PROXMOX_TOKEN_ID"])},
        "api_token_secret": {"type": "str", "no_log": True, "fallback": (env_fallback, ["PROXMOX_TOKEN_SECRET"])},
        "validate_certs": {"type": "bool", "default": True, "fallback": (env_fallback, ["PROXMOX_VALIDATE_CERTS"])},
        "ca_path": {"type": "path", "fallback": (env_fallback, ["PROXMOX_CA_PATH"])},
        "api_timeout": {"type": "int", "default": DEFAULT_API_TIMEOUT},
    }


PROXMOX_CONNECTION_REQUIRED_ONE_OF = [("api_password", "api_token_id")]
PROXMOX_CONNECTION_REQUIRED_TOGETHER = [("api_token_id", "api_token_secret")]


class ProxmoxError(Exception):
    """Anything that stops a conversation with the API; str() is a sentence for the user."""


class ProxmoxApiError(ProxmoxError):
    """The API answered with an error status (PVE's message kept as it is)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.pve_message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class ProxmoxAuthError(ProxmoxError):
    """The credentials were refused."""


class ProxmoxTlsError(ProxmoxError):
    """The server's certificate could not be verified."""


class ProxmoxUnreachable(ProxmoxError):
    """The API could not be reached, even after retries."""


class AmbiguousPost(ProxmoxError):
    """A POST whose outcome is unknown: the server may or may not have acted on it."""

    def __init__(self, method: str, path: str, cause: str) -> None:
        self.method = method
        self.path = path
        super().__init__(f"{method} {path}: no answer, it may or may not have been carried out ({cause})")


@dataclass(frozen=True)
class ProxmoxConnection:
    """Where the API is and who we are there. Secrets stay out of repr()."""

    host: str
    user: str
    port: int | None = None
    password: str | None = None
    token_id: str | None = None
    token_secret: str | None = None
    validate_certs: bool = True
    ca_path: str | None = None
    timeout: float = DEFAULT_API_TIMEOUT

    def __repr__(self) -> str:
        auth = f"token {self.token_id}" if self.token_id else "ticket"
        return f"ProxmoxConnection({self.user}@{self.url}, {auth})"

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ProxmoxConnection:
        """From a module's parameters (the names of proxmox_connection_spec)."""
        return cls(
            host=params["api_host"],
            port=params.get("api_port"),
            user=params["api_user"],
            password=params.get("api_password"),
            token_id=params.get("api_token_id"),
            token_secret=params.get("api_token_secret"),
            validate_certs=params.get("validate_certs", True),
            ca_path=params.get("ca_path"),
            # Only a missing value takes the default: 0 is a mistake to report, not to replace.
            timeout=DEFAULT_API_TIMEOUT if params.get("api_timeout") is None else params["api_timeout"],
        )

    def check_options(self, checks: OptionChecks) -> None:
        """Note in `checks` what is wrong with the connection options, each problem naming its option.

        No problem shows the value of a secret, and none shows a value with a control character.
        """
        # These go into a request line or header (the user and token as "PVEAPIToken=user!id=secret"),
        # where http.client refuses a control character with an error that quotes the whole header.
        for option, value in (("api_host", self.host), ("api_user", self.user), ("api_password", self.password),
                              ("api_token_id", self.token_id), ("api_token_secret", self.token_secret)):
            if value and _has_control_character(value):
                checks.add(
                    option,
                    "contains a control character (a newline, carriage return, tab or the like), which"
                    " no valid value has; the value is not shown. A YAML block scalar (|) ends with a newline:"
                    " use |- or a quoted string",
                )
        if self.port is not None and not 0 < self.port < 65536:
            checks.add("api_port", f"must be a TCP port (1-65535), got {self.port}")
        checks.check(check_seconds, "api_timeout", self.timeout, allow_minimum=False)
        if self.ca_path and not os.path.isfile(self.ca_path):
            checks.add("ca_path", f"{self.ca_path} is not a file (give the PEM file of the cluster's CA)")

    def redact(self, text: str) -> str:
        """`text` with every form of the password and the token secret masked.

        Libraries quote what they refuse: repr() escapes a newline, a header is bytes, a form body
        is URL-encoded, and Ansible masks only the value exactly as given. So each of those forms of
        the secret, and of the secret stripped of surrounding whitespace, is masked, the longest first.
        """
        forms: set[str] = set()
        for secret in (self.password, self.token_secret):
            for value in {secret, secret.strip()} if secret else ():
                forms.update((value, repr(value)[1:-1], repr(value.encode("utf-8", "surrogateescape"))[2:-1],
                              json.dumps(value)[1:-1], quote(value, safe=""), quote_plus(value)))
        for form in sorted((f for f in forms if f), key=len, reverse=True):
            text = text.replace(form, REDACTED)
        return text

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"https://{host}:{self.port or DEFAULT_PORT}"

    @property
    def uses_token(self) -> bool:
        return bool(self.token_id)

    @property
    def identity(self) -> str:
        """Who PVE says did something: the user, or user!token for a token."""
        return f"{self.user}!{self.token_id}" if self.token_id else self.user

    @property
    def verify(self) -> bool | str:
        """What requests takes as `verify`: a CA bundle path, or a plain yes/no."""
        if not self.validate_certs:
            return False
        return self.ca_path or True


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request that failed for a passing reason is sent again."""

    attempts: int = 4
    first_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 5.0

    def delays(self) -> list[float]:
        """The pauses between attempts."""
        return list(islice(backoff(self.first_delay, self.factor, self.max_delay), max(self.attempts - 1, 0)))


def _has_control_character(value: str) -> bool:
    """Whether `value` holds a C0 or C1 control character or DEL (a newline, a tab, ...)."""
    return any(unicodedata.category(char) == "Cc" for char in value)


def _root_cause(exc: BaseException) -> str:
    """The innermost reason of a requests/urllib3 error chain, which is the one that names the problem."""
    texts: list[str] = []
    seen: set[int] = set()
    queue: list[BaseException] = [exc]
    while queue:
        inner = queue.pop(0)
        if id(inner) in seen:
            continue
        seen.add(id(inner))
        texts.append(str(inner))
        queue.extend(arg for arg in getattr(inner, "args", ()) if isinstance(arg, BaseException))
        reason = getattr(inner, "reason", None)
        queue.extend(cause for cause in (reason, inner.__cause__, inner.__context__) if isinstance(cause, BaseException))
    for text in texts:
        match = re.search(r"\[SSL[^\]]*\][^()'\"]*", text)
        if match:
            return match.group(0).strip()
    return next((text for text in reversed(texts) if text), repr(exc))


def _never_sent(exc: BaseException) -> bool:
    """True when the request certainly did not reach the server (no connection was made)."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    text = repr(exc)
    return "NewConnectionError" in text or "Connection refused" in text or "Name or service not known" in text


class ProxmoxClient:
    """GET and POST against one PVE API, with the retries and the ticket renewal described above."""

    def __init__(
        self,
        connection: ProxmoxConnection,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = pause,
    ) -> None:
        if not HAS_PROXMOXER:
            raise ProxmoxError("the proxmoxer and requests Python packages are needed on the controller")
        self.connection = connection
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self.logins = 0
        self._api: Any = self._login()

    # ------------------------------------------------------------------ login

    def _login(self) -> Any:
        """A proxmoxer API object; with a password this POSTs /access/ticket, which is safe to repeat."""
        conn = self.connection
        kwargs: dict[str, Any] = {
            "host": conn.host,
            "port": conn.port or DEFAULT_PORT,
            "user": conn.user,
            "verify_ssl": conn.verify,
            "timeout": conn.timeout,
        }
        if conn.uses_token:
            kwargs.update(token_name=conn.token_id, token_value=conn.token_secret)
        else:
            kwargs["password"] = conn.password
        last: Exception | None = None
        for delay in self.retry.delays() + [None]:
            try:
                api = ProxmoxAPI(backend="https", **kwargs)
                if not conn.uses_token:
                    self.logins += 1
                return api
            except AuthenticationError as exc:
                code = re.search(r"code: (\d+)", str(exc))
                if not code or int(code.group(1)) < 500:
                    raise ProxmoxAuthError(
                        f"{conn.url}: the login of {conn.user} was refused"
                        f" (HTTP {code.group(1) if code else '?'}): check api_user and api_password"
                    ) from None
                last = exc
            except requests.exceptions.SSLError as exc:
                raise self._tls_error(exc) from None
            except requests.exceptions.RequestException as exc:
                last = exc
            except ValueError as exc:
                # A login may be repeated, so it is never ambiguous.
                raise ProxmoxError(f"{conn.url}: could not log in: {self._library_error(exc)}") from None
            if delay is not None:
                self._sleep(delay)
        raise ProxmoxUnreachable(f"{conn.url}: could not log in: {self._cause(last) if last else 'unknown'}")

    def _cause(self, exc: BaseException) -> str:
        """The root cause of a library error, in words, with the secrets masked."""
        return self.connection.redact(_root_cause(exc))

    def _library_error(self, exc: ValueError) -> str:
        """A ValueError of the HTTP libraries, in words, with the secrets masked.

        http.client refuses a header with a newline by quoting the whole header, which for a token
        is "PVEAPIToken=user!id=secret".
        """
        return self.connection.redact(f"the HTTP library refused the request: {exc}")

    def _tls_error(self, exc: BaseException) -> ProxmoxTlsError:
        conn = self.connection
        against = f"the CA in ca_path={conn.ca_path}" if conn.ca_path else "the system's CA certificates"
        return ProxmoxTlsError(
            f"{conn.url}: TLS certificate verification failed against {against}: {self._cause(exc)}."
            " Give the cluster's CA certificate as ca_path (validate_certs=false turns the check off)."
        )

    # --------------------------------------------------------------- requests

    def get(self, path: str, **params: Any) -> Any:
        """A read: retried with backoff on connection errors, timeouts and 5xx answers."""
        return self._request("GET", path, params)

    def post(self, path: str, **data: Any) -> Any:
        """A change: repeated only when the server certainly did not act on it, else AmbiguousPost."""
        return self._request("POST", path, data)

    def _request(self, method: str, path: str, payload: dict[str, Any]) -> Any:
        delays = self.retry.delays()
        renewed = False
        attempt = 0
        while True:
            try:
                resource = self._api(path.strip("/"))
                if method == "GET":
                    return resource.get(**payload)
                return resource.post(**payload)
            except ResourceException as exc:
                error = ProxmoxApiError(method, path, exc.status_code, self.connection.redact(_pve_message(exc)))
                if exc.status_code == 401:
                    # Nothing runs before authentication, so any request may be sent again with a
                    # fresh ticket. A token refused is not going to get better.
                    if self.connection.uses_token or renewed:
                        raise ProxmoxAuthError(
                            f"{error}: check the credentials (api_user, api_token_id/api_token_secret or api_password)"
                        ) from None
                    renewed = True
                    self._api = self._login()
                    continue
                if not self._may_retry_answer(method, exc.status_code, error.pve_message):
                    if method == "POST" and exc.status_code in PROXY_STATUSES:
                        raise AmbiguousPost(method, path, f"HTTP {exc.status_code} {error.pve_message}") from None
                    raise error from None
                cause: Exception = error
            except requests.exceptions.SSLError as exc:
                raise self._tls_error(exc) from None
            except requests.exceptions.RequestException as exc:
                if method == "POST" and not _never_sent(exc):
                    raise AmbiguousPost(method, path, self._cause(exc)) from None
                cause = ProxmoxUnreachable(f"{method} {path}: {self._cause(exc)}")
            except ValueError as exc:
                if method == "POST":
                    raise AmbiguousPost(method, path, self._library_error(exc)) from None
                raise ProxmoxError(f"{method} {path}: {self._library_error(exc)}") from None
            if attempt >= len(delays):
                raise cause
            self._sleep(delays[attempt])
            attempt += 1

    @staticmethod
    def _may_retry_answer(method: str, status: int, message: str) -> bool:
        if status < 500 or status == 501:
            return False
        if method == "GET":
            return not any(word in message for word in PERMANENT_READ_ERRORS)
        return status == 500 and any(word in message for word in TRANSIENT_REFUSALS)


def _pve_message(exc: Any) -> str:
    """PVE's own wording: the reason phrase it sets, plus per-field errors for a 400."""
    message = str(exc.content or exc.status_message or "").strip()
    errors = exc.errors
    if errors and isinstance(errors, dict):
        message += " " + "; ".join(f"{key}: {str(val).strip()}" for key, val in sorted(errors.items()))
    return message
