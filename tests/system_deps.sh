#!/usr/bin/env bash
# Debian packages that tests need as real servers (PostgreSQL for shared Optuna studies, OpenSSH
# for a DVC remote) or as a real browser (Chromium, driven by Playwright in tests/test_report.py).
# Installed only when missing; the tests start and stop the servers themselves.
set -euo pipefail
need=()
[ -x /usr/lib/postgresql/*/bin/initdb ] 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests need Debian packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
  echo "installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # the packages' own services are not wanted: tests start private instances
  service postgresql stop >/dev/null 2>&1 || true
  service ssh stop >/dev/null 2>&1 || true
fi
