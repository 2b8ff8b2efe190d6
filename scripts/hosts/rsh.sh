#!/usr/bin/env bash
# Open MPI's remote shell for emulated hosts (--mca plm_rsh_agent): "rsh.sh <address> <cmd...>"
# runs the command in the namespace that owns the address (10.78.0.<i+1> is fvhost<i>), under
# that host's own hostname: Open MPI names shared-memory segments after the hostname, and two
# "hosts" with one name collide.
addr=$1
shift
i=$((${addr##*.} - 1))
exec ip netns exec "fvhost$i" unshare --uts /bin/sh -c "hostname fvhost$i; $*"
