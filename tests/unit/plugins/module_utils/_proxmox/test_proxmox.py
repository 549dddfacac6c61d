"""The shared Proxmox client against a real fakepve server over HTTPS (no containers needed)."""

from __future__ import annotations

import json
from urllib.parse import quote_plus

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    AmbiguousPost,
    ProxmoxApiError,
    ProxmoxAuthError,
    ProxmoxClient,
    ProxmoxConnection,
    ProxmoxError,
    ProxmoxTlsError,
    ProxmoxUnreachable,
    RetryPolicy,
    proxmox_connection_spec,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from tests.harness.fakepve_lxc import FakePveServer, expire_tickets, make_pki

FAST = RetryPolicy(attempts=3, first_delay=0.01, factor=2, max_delay=0.05)
REBOOT = "nodes/pve1/lxc/200/status/reboot"


def connection_problems(connection: ProxmoxConnection) -> list[str]:
    checks = OptionChecks()
    connection.check_options(checks)
    return [str(problem) for problem in checks.problems]


@pytest.fixture
def pve_time_scale() -> float:
    return 0.0  # fakepve's tasks take no time: these tests are about the client, not the tasks


def connect(server: FakePveServer, **overrides) -> ProxmoxConnection:
    fields = dict(host=server.host, port=server.port, user="root@pam", password=server.password,
                  ca_path=server.pki.ca_path, timeout=2)
    fields.update(overrides)
    return ProxmoxConnection(**fields)


def client(server: FakePveServer, **overrides) -> ProxmoxClient:
    return ProxmoxClient(connect(server, **overrides), retry=FAST)


# ------------------------------------------------------------------------------------ options


def test_connection_options_carry_over_from_community_proxmox():
    spec = proxmox_connection_spec()
    fallbacks = {name: opt["fallback"][1] for name, opt in spec.items() if "fallback" in opt}
    assert fallbacks["api_host"] == ["PROXMOX_HOST"]
    assert fallbacks["api_port"] == ["PROXMOX_PORT"]
    assert fallbacks["api_user"] == ["PROXMOX_USER"]
    assert fallbacks["api_password"] == ["PROXMOX_PASSWORD"]
    assert fallbacks["api_token_id"] == ["PROXMOX_TOKEN_ID"]
    assert fallbacks["api_token_secret"] == ["PROXMOX_TOKEN_SECRET"]
    assert spec["validate_certs"]["default"] is True
    assert spec["api_password"]["no_log"] and spec["api_token_secret"]["no_log"]


def test_connection_repr_keeps_secrets_out():
    conn = ProxmoxConnection(host="pve", user="root@pam", password="hunter2", token_id="t", token_secret="s3cr3t")
    assert "hunter2" not in repr(conn) and "s3cr3t" not in repr(conn)
    assert conn.identity == "root@pam!t"
    assert ProxmoxConnection(host="fe80::1", user="u@pve").url == "https://[fe80::1]:8006"


def test_connection_problems_name_the_option(tmp_path):
    conn = ProxmoxConnection(host="pve", user="root@pam", port=70000, timeout=0, ca_path=str(tmp_path / "none.pem"))
    problems = " / ".join(connection_problems(conn))
    assert "api_port" in problems and "api_timeout" in problems and "ca_path" in problems
    assert connection_problems(ProxmoxConnection(host="pve", user="root@pam")) == []


@pytest.mark.parametrize("timeout, words", [
    (0, "api_timeout: must be more than 0 and at most 86400 seconds, got 0"),
    (-5, "api_timeout: must be more than 0 and at most 86400 seconds, got -5"),
    (10**12, "api_timeout: must be more than 0 and at most 86400 seconds, got 1e+12"),
    (float("nan"), "api_timeout: must be a finite number of seconds, got nan"),
    (float("inf"), "api_timeout: must be a finite number of seconds, got inf"),
])
def test_api_timeout_is_finite_and_bounded(timeout, words):
    assert connection_problems(ProxmoxConnection(host="pve", user="root@pam", timeout=timeout)) == [words]


def test_api_timeout_zero_is_reported_not_replaced_by_the_default():
    params = {"api_host": "pve", "api_user": "root@pam", "api_timeout": 0}
    assert ProxmoxConnection.from_params(params).timeout == 0
    assert ProxmoxConnection.from_params(dict(params, api_timeout=None)).timeout == 10
    assert connection_problems(ProxmoxConnection.from_params(dict(params, api_timeout=3))) == []


SECRET = "3f9c2d1e-0b7a-4c55-9e21-6d8f0a1b2c3d"
CONTROL = ["\n", "\r\n", "\t", "\x00", "\x7f", "\x85", "\x1b[0m"]


@pytest.mark.parametrize("option, field", [
    ("api_password", "password"), ("api_token_secret", "token_secret"),
    ("api_user", "user"), ("api_token_id", "token_id"), ("api_host", "host"),
])
@pytest.mark.parametrize("control", CONTROL)
def test_control_characters_are_refused_naming_the_option_never_the_value(option, field, control):
    fields = dict(host="pve", user="root@pam", token_id="relaunch", token_secret="t0ken-secret")
    fields[field] = SECRET + control
    problems = connection_problems(ProxmoxConnection(**fields))
    assert len(problems) == 1 and problems[0].startswith(f"{option}: contains a control character")
    assert SECRET not in problems[0] and SECRET[:8] not in problems[0]


def test_a_good_secret_with_inner_spaces_and_punctuation_is_accepted():
    conn = ProxmoxConnection(host="pve", user="ops@pve", password="correct horse: battery staple!")
    assert connection_problems(conn) == []


def test_redact_masks_every_form_of_the_secrets():
    secret = SECRET + "\n"
    conn = ProxmoxConnection(host="pve", user="root@pam", password="pa ss'w\"ord\t", token_id="t", token_secret=secret)
    texts = [
        f"Invalid header value {('PVEAPIToken=root@pam!t=' + secret).encode()!r}",
        f"header {secret!r} refused", f"as given: {secret}", f"stripped: {SECRET}.",
        f"json: {json.dumps(secret)}", f"form: password={quote_plus(conn.password)}", f"{conn.password!r}",
    ]
    for text in texts:
        redacted = conn.redact(text)
        assert "********" in redacted, text
        assert SECRET not in redacted and "pa ss" not in redacted and "w\\\"ord" not in redacted, redacted
    assert conn.redact("nothing secret here") == "nothing secret here"
    assert ProxmoxConnection(host="pve", user="root@pam").redact("no secrets at all") == "no secrets at all"


def test_retry_policy_backs_off_up_to_its_cap():
    assert RetryPolicy(attempts=5, first_delay=0.5, factor=2, max_delay=1.5).delays() == [0.5, 1.0, 1.5, 1.5]
    assert RetryPolicy(attempts=1).delays() == []


# -------------------------------------------------------------------------------------- login


def test_ticket_login_and_token_auth_both_work(server):
    assert client(server).get("version")["version"]
    secret = server.add_token("root@pam", "relaunch")
    api = client(server, password=None, token_id="relaunch", token_secret=secret)
    assert [ct["vmid"] for ct in api.get("nodes/pve1/lxc")] == [200]
    assert len(server.requests("POST", "/access/ticket")) == 1  # the token needed none


def test_wrong_password_is_an_auth_error_not_retried(server):
    with pytest.raises(ProxmoxAuthError, match="login of root@pam was refused"):
        client(server, password="wrong")
    assert len(server.requests("POST", "/access/ticket")) == 1


def test_wrong_token_is_an_auth_error_not_retried(server):
    server.add_token("root@pam", "relaunch")
    api = client(server, password=None, token_id="relaunch", token_secret="nope")
    with pytest.raises(ProxmoxAuthError, match="401"):
        api.get("version")
    assert len(server.requests("GET", "/version")) == 1


def test_expired_ticket_is_renewed_once(server):
    api = client(server)
    server.expire_tickets()
    assert api.get("version")["version"]
    assert api.logins == 2


def test_ticket_that_keeps_expiring_fails_after_one_renewal(server):
    api = client(server)
    server.before_request("GET", "/version", expire_tickets, times=5)
    with pytest.raises(ProxmoxAuthError, match="401"):
        api.get("version")
    assert api.logins == 2


def test_wrong_ca_is_a_tls_error_and_validate_certs_false_skips_the_check(server, tmp_path):
    stranger = make_pki(tmp_path / "stranger")
    with pytest.raises(ProxmoxTlsError, match="CERTIFICATE_VERIFY_FAILED"):
        client(server, ca_path=stranger.ca_path)
    assert client(server, ca_path=None, validate_certs=False).get("version")


def test_nothing_listening_is_unreachable_after_retries(server):
    with pytest.raises(ProxmoxUnreachable, match="could not log in"):
        ProxmoxClient(ProxmoxConnection(host="127.0.0.1", port=1, user="root@pam", password="x", timeout=1), retry=FAST)


# ------------------------------------------------------------------------------------- reads


def test_reads_are_retried_through_proxy_errors(server):
    api = client(server)
    server.call(server.pve.fail, "GET", "/cluster/resources", 502, "Bad Gateway", times=2)
    assert [guest["vmid"] for guest in api.get("cluster/resources", type="vm")] == [200]
    assert len(server.requests("GET", "/cluster/resources")) == 3


def test_reads_give_up_after_the_policys_attempts_with_pves_words(server):
    api = client(server)
    server.call(server.pve.fail, "GET", "/cluster/resources", 500, "cluster not ready - no quorum?")
    with pytest.raises(ProxmoxApiError, match="no quorum") as caught:
        api.get("cluster/resources")
    assert caught.value.status == 500
    assert len(server.requests("GET", "/cluster/resources")) == FAST.attempts


def test_a_guest_that_does_not_exist_is_not_retried(server):
    api = client(server)
    with pytest.raises(ProxmoxApiError, match="does not exist"):
        api.get("nodes/pve1/lxc/999/config")
    assert len(server.requests("GET", "/lxc/999/config")) == 1


def test_flaky_reads_get_through(server):
    api = client(server, timeout=1)
    api.retry = RetryPolicy(attempts=6, first_delay=0.01, max_delay=0.05)
    server.flaky_network(drop_rate=0.4, seed=3)
    for _request in range(10):
        assert api.get("nodes/pve1/lxc/200/status/current")["status"] == "running"
    assert len(server.received("GET")) > len(server.requests("GET")), "no request was dropped"


# ------------------------------------------------------------------------------------- writes


def test_post_refused_by_a_proxy_is_ambiguous_and_not_repeated(server):
    api = client(server)
    server.call(server.pve.fail, "POST", "/" + REBOOT, 502, "Bad Gateway", times=1)
    with pytest.raises(AmbiguousPost, match="may or may not"):
        api.post(REBOOT)
    assert len(server.requests("POST", "/status/reboot")) == 1


def test_post_whose_answer_is_lost_is_ambiguous_and_not_repeated(server):
    api = client(server)
    server.drop_answer("POST", "/status/reboot")
    with pytest.raises(AmbiguousPost):
        api.post(REBOOT)
    assert len(server.requests("POST", "/status/reboot")) == 1
    assert len(server.tasks(200, "vzreboot")) == 1  # the server did act on it


def test_post_refused_for_lost_quorum_is_sent_again(server):
    api = client(server)
    server.call(server.pve.fail, "POST", "/" + REBOOT, error="no_quorum", times=1)
    upid = api.post(REBOOT)
    assert upid.startswith("UPID:pve1:")
    assert len(server.requests("POST", "/status/reboot")) == 2
    assert len(server.tasks(200, "vzreboot")) == 1


def test_post_after_an_expired_ticket_is_sent_again_with_a_new_one(server):
    api = client(server)
    server.expire_tickets()
    assert api.post(REBOOT).startswith("UPID:")
    assert api.logins == 2
    assert len(server.requests("POST", "/status/reboot")) == 2
    assert len(server.tasks(200, "vzreboot")) == 1


def test_post_forbidden_fails_once_with_pves_message(server):
    password = server.add_user("ops@pve")
    server.call(server.pve.grant, "ops@pve", "/vms/200", "VM.Audit")
    api = client(server, user="ops@pve", password=password)
    with pytest.raises(ProxmoxApiError, match=r"Permission check failed \(/vms/200, VM.PowerMgmt\)") as caught:
        api.post(REBOOT)
    assert caught.value.status == 403
    assert len(server.requests("POST", "/status/reboot")) == 1


def test_bad_parameter_names_the_field(server):
    api = client(server)
    with pytest.raises(ProxmoxApiError, match="Parameter verification failed. timeout:") as caught:
        api.post(REBOOT, timeout="soon")
    assert caught.value.status == 400


# ------------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize("field", ["token_secret", "user"])
def test_a_header_the_http_library_refuses_is_an_error_without_the_secret(server, field):
    # What check_options() refuses up front, had it got through: http.client quotes the whole header.
    secret = server.add_token("root@pam", "relaunch")
    fields = dict(password=None, token_id="relaunch", token_secret=secret)
    fields[field] = fields.get(field, "root@pam") + "\n"
    api = client(server, **fields)
    with pytest.raises(ProxmoxError) as caught:
        api.get("version")
    message = str(caught.value)
    assert "the HTTP library refused the request" in message and "********" in message
    assert secret not in message and secret not in repr(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert server.requests("GET", "/version") == []  # refused before it was sent


def test_a_post_the_http_library_refuses_is_ambiguous_and_without_the_secret(server):
    secret = server.add_token("root@pam", "relaunch")
    api = client(server, password=None, token_id="relaunch", token_secret=secret + "\r\n")
    with pytest.raises(AmbiguousPost) as caught:
        api.post(REBOOT)
    assert secret not in str(caught.value)
    assert server.requests("POST", "/status/reboot") == []


def test_pves_own_words_are_redacted_too(server):
    secret = server.add_token("root@pam", "relaunch")
    api = client(server, password=None, token_id="relaunch", token_secret=secret)
    server.call(server.pve.fail, "GET", "/version", 400, f"token {secret} is not what I expected")
    with pytest.raises(ProxmoxApiError) as caught:
        api.get("version")
    assert secret not in str(caught.value) and secret not in caught.value.pve_message
    assert "token ******** is not what I expected" in str(caught.value)
