#!/usr/bin/env bash
# Makes a minimal Debian root with debootstrap and imports it as a local base
# image, for machines that cannot pull `ubuntu:24.04` from a registry:
#
#   deploy/image/debian-base.sh ENGINE [IMAGE] [SUITE]
#
# ENGINE is docker or podman (with any global flags, quoted as one word:
# "podman --runtime runc"); IMAGE defaults to localhost/tgi-py-base:bookworm,
# SUITE to bookworm. The packages come from the mirror apt already uses on
# this machine. Does nothing when IMAGE exists. Needs root and debootstrap.
set -euo pipefail
engine=${1:?usage: $0 ENGINE [IMAGE] [SUITE]}
image=${2:-localhost/tgi-py-base:bookworm}
suite=${3:-bookworm}

if $engine image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image exists"
    exit 0
fi

# The first Debian mirror named in apt's sources (deb822 or one-line form).
mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ && /debian\/?$/ {print $2; exit}')
[ -n "$mirror" ] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk '$1 == "deb" && $3 !~ /security/ {print $2; exit}')
mirror=${mirror:-http://deb.debian.org/debian}

root=$(mktemp -d /var/tmp/tgi-py-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap $suite from $mirror into $root"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log"; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# Nothing of the build host's apt state: the image's own `apt-get update`
# fetches fresh lists.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | $engine import - "$image"
echo "imported $image"
