#!/usr/bin/env bash
# System packages the tests use, from Debian's archive: Fashion-MNIST's real files (dataset-fashion-mnist) and the
# browser the dashboard's end-to-end test drives (chromium; playwright downloads no browser of its own), and iptables
# for the NAT the network tests build between namespaces.
# Installs them when run as root (CI); otherwise says what is missing and how to get it.
set -euo pipefail
missing=()
[ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || missing+=(iptables)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "Installing ${missing[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "The tests need these Debian packages: ${missing[*]}. Install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
