# Two entry points: `make demo` and `make test`. Each does its own set-up on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

VENV      := .venv
PY        := $(VENV)/bin/python
BIN       := $(CURDIR)/$(VENV)/bin
BUILD     := .build
COLL_LINK := $(BUILD)/collections/ansible_collections/gpuops/relaunch
SANITY    := $(BUILD)/sanity/ansible_collections/gpuops/relaunch
APT_PKGS  := lxc openssh-server debootstrap gcc libc6-dev openjdk-17-jre-headless nftables
PROM      := $(BUILD)/prometheus
PROMTOOL  := $(PROM)/usr/bin/promtool
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(BIN):$(PATH)

.PHONY: lock setup apt venv demo-venv collection prometheus-tools demo test pytest sanity lint docs-lint rules-test molecule matrix bench clean

setup: apt venv collection

# apt packages the tests use: real LXC containers, a real sshd for the pct_remote path,
# debootstrap for the systemd container, Java 17 for ansible-rulebook's rule engine (drools_jpy).
# nftables: the gpu_health test makes the kernel itself write XID lines (a log rule on a loopback packet).
# The stamp is older than the Makefile when APT_PKGS changed: the check below runs again (it installs
# only what is missing).
apt: $(BUILD)/apt.stamp
$(BUILD)/apt.stamp: Makefile
	@mkdir -p $(BUILD)
	@missing=$$(for p in $(APT_PKGS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages: $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@

# The pip calls. A machine whose pip configuration (pip config list: here /root/.config/pip/pip.conf)
# names local file:// indexes (extra-index-url file:///opt/pypi/simple) makes pip warn once per
# package and index that has no directory there ("WARNING: Location 'file:///opt/pypi/simple/x/' is
# ignored: it is neither a file nor a directory"): twenty lines that are the machine's, not ours.
# PIP_FILTER drops exactly those lines; every other line, errors and other warnings, passes, and the
# status is pip's (pipefail, see .SHELLFLAGS). sed -u: lines pass as pip writes them.
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt
PIP_FILTER  := sed -u "/^WARNING: Location 'file:[^']*' is ignored: /d"

venv: $(VENV)/.installed
# requirements/*.txt name ranges (what users install); constraints.txt pins the exact versions the
# tests run with, so a fresh clone gets the same venv.
$(VENV)/.installed: requirements/controller.txt requirements/test.txt requirements/constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -r requirements/test.txt 2>&1 | $(PIP_FILTER)
	@touch $@

# What the demo runs: a controller's packages (requirements/controller.txt: ansible-core, proxmoxer,
# requests, paramiko), not the tests' toolchain. A venv that `make venv` filled has them already.
demo-venv: $(VENV)/.installed-demo
$(VENV)/.installed-demo: requirements/controller.txt requirements/constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -r requirements/controller.txt 2>&1 | $(PIP_FILTER)
	@touch $@

# Debian's prometheus (promtool and the server), prometheus-node-exporter and prometheus-alertmanager,
# unpacked under .build/prometheus (usr/bin/promtool, usr/bin/prometheus, usr/bin/prometheus-node-exporter,
# usr/bin/prometheus-alertmanager) with dpkg-deb -x: no maintainer script runs and no daemon starts.
# rules-test, the metrics tests and the event chain's test use them. One file goes system-wide: Debian's
# Alertmanager reads its notification templates from /usr/share/prometheus/alertmanager only (a path
# built into the binary) and will not start without them; they are put there where they are missing.
PROM_DEBS := prometheus prometheus-node-exporter prometheus-alertmanager
# The stamp's name lists the packages: a checkout unpacked before PROM_DEBS changed unpacks again.
empty :=
space := $(empty) $(empty)
PROM_STAMP := $(PROM)/.stamp-$(subst $(space),+,$(strip $(PROM_DEBS)))
prometheus-tools: $(PROM_STAMP)
$(PROM_STAMP):
	rm -rf $(PROM) && mkdir -p $(PROM)/debs
	@# apt-get download as root warns that _apt cannot write the folder; the download is the same.
	cd $(PROM)/debs && { apt-get download -qq $(PROM_DEBS) 2>/dev/null \
	  || { apt-get update -qq && apt-get download -qq $(PROM_DEBS); }; }
	for deb in $(PROM)/debs/*.deb; do dpkg-deb -x "$$deb" $(PROM); done
	rm -rf $(PROM)/debs
	for tmpl in default.tmpl email.tmpl; do test -e /usr/share/prometheus/alertmanager/$$tmpl \
	  || install -D -m 0644 $(PROM)/usr/share/prometheus/alertmanager/$$tmpl /usr/share/prometheus/alertmanager/$$tmpl; done
	$(PROMTOOL) --version >/dev/null && $(PROM)/usr/bin/prometheus-node-exporter --version >/dev/null 2>&1
	$(PROM)/usr/bin/prometheus --version >/dev/null 2>&1 && $(PROM)/usr/bin/prometheus-alertmanager --version >/dev/null 2>&1
	@touch $@

# Ansible finds this checkout as gpuops.relaunch through ansible.cfg's collections_path.
collection: $(COLL_LINK)
$(COLL_LINK):
	@mkdir -p $(dir $@)
	ln -sfn $(CURDIR) $@

# No apt packages: the demo's processes are plain Python on this machine.
demo: demo-venv collection
	$(BIN)/ansible-playbook -i playbooks/inventory/demo.yml playbooks/demo.yml

# pytest-xdist: most tests wait on real processes (a supervisor's min_uptime, a stop's grace, an LXC
# container's boot), not on the CPU, so PYTEST_WORKERS test files run at once. A file's tests stay
# on one worker (--dist loadfile): they share module fixtures and, in a few files, the job marks
# that tell their processes apart. PYTEST_WORKERS=0 runs them one by one.
PYTEST_WORKERS ?= 3
pytest: setup prometheus-tools
	@# Exit code 5 means "no tests collected": that is a failure here, never a pass.
	@# GPUOPS_REQUIRE_TOOLS: a test whose unpacked Debian binaries are missing fails here instead of skipping.
	GPUOPS_REQUIRE_TOOLS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests/unit tests/integration

# ansible-test wants a real tree under ansible_collections/<ns>/<name>: copy what git tracks
# (plus new files), make it a repository of its own, and run there. Its get-pip download is answered offline by tools/get_pip_standin.py.
sanity: setup
	rm -rf $(SANITY) && mkdir -p $(SANITY)
	git ls-files -co --exclude-standard | tar --ignore-failed-read -cf - -T - 2>/dev/null | tar -xf - -C $(SANITY)
	mkdir -p $(HOME)/.ansible/test/cache
	cp tools/get_pip_standin.py $(HOME)/.ansible/test/cache/get_pip_24_2.py
	@# A repository of its own: otherwise ansible-test sees this checkout's .gitignore, which ignores .build/.
	cd $(SANITY) && git init -q && git add -A
	cd $(SANITY) && $(BIN)/ansible-test sanity --venv --python 3.11 --color no

lint: setup
	$(BIN)/ansible-lint --profile production --offline

# The changelog fragments and the documentation as antsibull (the Ansible package's docs build) reads them.
docs-lint: setup
	$(BIN)/antsibull-changelog lint
	$(BIN)/antsibull-docs lint-collection-docs --plugin-docs $(COLL_LINK)

# The alert rules of extensions/prometheus/: promtool checks them and runs their unit tests.
rules-test: prometheus-tools
	$(PROMTOOL) check rules extensions/prometheus/rules/*.yml
	$(PROMTOOL) test rules extensions/prometheus/tests/*.yml

# The Molecule scenarios (extensions/molecule/): each creates a PID namespace whose init never reaps
# (container_reset: a real LXC container behind fakepve), runs a role in it over
# community.docker.nsenter (converge, idempotence, verify) and destroys it.
molecule: setup
	cd extensions && $(BIN)/molecule test --all

# The support matrix (tools/matrix.py): the built and installed tarball's relaunch.yml on localhost
# (a launch, a no-op, a stop) with the oldest ansible-core meta/runtime.yml claims (2.16, Python 3.11)
# and the newest (2.21, Python 3.13), each in a venv of its own under .build/matrix, pinned by
# requirements/matrix-*.txt and made once (a stamp keeps it until the pins or the interpreter change).
matrix: setup
	$(PY) tools/matrix.py

# The checks run beside the tests, two at a time: pytest (whose workers mostly wait) and, one after
# the other, the static checks, the rules, Molecule and the matrix, each in directories of its own
# (private lxcpaths, ports and PID namespaces), so none sees another's processes. A target's output
# is shown whole when it ends.
CHECKS := sanity lint docs-lint rules-test molecule matrix
test: setup prometheus-tools
	$(MAKE) --no-print-directory -j2 --output-sync=target pytest $(CHECKS)

bench: setup prometheus-tools
	$(PY) bench/scan_vs_ps.py
	$(PY) bench/gpu_wait_latency.py
	$(PY) bench/fleet_relaunch.py
	$(PY) bench/pct_connection.py
	$(PY) bench/event_chain_latency.py
	$(PY) bench/live_health_cpu.py
	$(PY) bench/gpu_health.py
	$(PY) bench/checkpoint_resume.py

clean:
	rm -rf $(BUILD) $(VENV)

# The locks (tools/lock.py): requirements/constraints.txt for .venv and requirements/matrix-*.txt for the
# support matrix, each the pip freeze of a fresh venv. UPGRADE=1 resolves every pin anew.
lock: venv
	$(PY) tools/lock.py $(if $(UPGRADE),--upgrade)
