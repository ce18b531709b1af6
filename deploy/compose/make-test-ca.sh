#!/bin/sh
# A throwaway test CA and one certificate it signed (server and client auth) for
# docker-compose.tls.yml: ca.pem, cert.pem, key.pem in secrets/tls/ beside this script,
# or in the folder given. The certificate names every host the services dial: the
# compose service names, localhost and 127.0.0.1 (each container's health check).
#
#   ./make-test-ca.sh [OUT_DIR]
#
# It runs `pdserve certs`: $PDSERVE if set, else the pdserve on PATH (a local install, e.g.
# the repository's .venv/bin/pdserve), else the image (docker run pdserve:cpu, or
# $PDSERVE_IMAGE), as your user so that you own the files. The CA's own key is never
# written: to add a host, make a new CA and restart every service. Not for production:
# there, a CA you run (the Helm chart takes cert-manager's).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/secrets/tls}
mkdir -p "$out"
out=$(cd "$out" && pwd)

set --
for host in etcd router prefill decode redis localhost 127.0.0.1; do
    set -- "$@" --host "$host"
done

if [ -n "${PDSERVE:-}" ]; then
    "$PDSERVE" certs --out "$out" "$@" >/dev/null
elif command -v pdserve >/dev/null 2>&1; then
    pdserve certs --out "$out" "$@" >/dev/null
else
    docker run --rm --user "$(id -u):$(id -g)" --volume "$out:/out" \
        "${PDSERVE_IMAGE:-pdserve:cpu}" certs --out /out "$@" >/dev/null
fi

echo "wrote $out/ca.pem, cert.pem, key.pem"
echo "the containers run as uid 10001: sudo chown 10001:10001 $out/*.pem"
