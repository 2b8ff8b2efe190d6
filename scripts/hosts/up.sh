#!/usr/bin/env bash
# Emulated hosts on this machine: N network namespaces fvhost0..fvhost<N-1> with addresses
# 10.78.0.1..N, each joined by a veth pair to a bridge in namespace fvhostsw. With a RATE
# (tc syntax: 1gbit, 10gbit, 500mbit), each host's link is limited in both directions by a token
# bucket (tbf); with a DELAY (e.g. 200us) netem adds latency where the kernel has it. Ranks in
# one namespace are one host: they share memory, and reach other hosts only through the links.
# Needs root. Anything left from an earlier run is removed first.
#
#   bash scripts/hosts/up.sh N [RATE] [DELAY]
#
# FERROVOD_HOSTS_SLOW=I:RATE: host I's link runs at RATE instead (a straggler).
# FERROVOD_HOSTS_QUEUE: the switch's queue toward each host, as tbf's latency (default 1ms: a
# longer queue lets a small message wait behind tens of MB of bulk data, and timings vary with
# it). Each host's own transmit queue holds 1 MB and each TCP connection keeps at most 256 KB in
# it (tcp_limit_output_bytes; the kernel's default is 1 MB): a packet dropped in the sender's
# own queue while none of its connection's packets is in flight stalls that connection for a
# whole retransmission timeout (200 ms), and with the rate estimate that veth's bursts inflate,
# one connection would otherwise fill the queue and drop the others' packets there — what a
# real NIC with small per-connection queues does not do (BENCHMARKS.md, "pipelined
# hierarchical allreduce").
# FERROVOD_HOSTS_CC: the hosts' TCP congestion control (default cubic, Linux's own default).
# Namespaces inherit the machine's, which on our machines is bbr: there two ranks exchanging at
# once over one connection ran whole steps at half the link's rate, Open MPI's own allreduce in
# most calls (BENCHMARKS.md, "Emulated hosts", the harness). Where the machine does not allow
# it for namespaces, it is added to net.ipv4.tcp_allowed_congestion_control.
# FERROVOD_HOSTS_MTU: the links' MTU (default 1500; 9000: jumbo frames). The token buckets then
# shape frames of up to that size, cutting larger batches of the kernel's (GSO) into them; the
# headers of every frame are charged to the rate at any MTU.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
n=${1:?usage: up.sh N [RATE] [DELAY]}
rate=${2:-}
delay=${3:-}
queue=${FERROVOD_HOSTS_QUEUE:-1ms}
mtu=${FERROVOD_HOSTS_MTU:-1500}
cc=${FERROVOD_HOSTS_CC:-cubic}
allowed=$(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control)
case " $allowed " in
  *" $cc "*) ;;
  *)
    if ! sysctl -q -w net.ipv4.tcp_allowed_congestion_control="$allowed $cc" 2>/dev/null; then
      machine=$(cat /proc/sys/net/ipv4/tcp_congestion_control)
      echo "up.sh: TCP $cc cannot be allowed here; the hosts keep the machine's $machine" >&2
      cc=$machine
    fi
    ;;
esac
bash "$here/down.sh"
ip netns add fvhostsw
ip -n fvhostsw link add fvhostbr type bridge
ip -n fvhostsw link set fvhostbr up
for i in $(seq 0 $((n - 1))); do
  ns=fvhost$i
  ip netns add "$ns"
  ip link add "fvh$i" type veth peer name "fvs$i"
  ip link set "fvh$i" netns "$ns"
  ip link set "fvs$i" netns fvhostsw
  ip -n fvhostsw link set "fvs$i" master fvhostbr
  ip -n fvhostsw link set "fvs$i" up
  ip -n "$ns" link set "fvh$i" mtu "$mtu"
  ip -n fvhostsw link set "fvs$i" mtu "$mtu"
  ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev "fvh$i"
  ip -n "$ns" link set lo up
  # at most 256 KB of each connection in the host's transmit queue (see above)
  ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_limit_output_bytes=262144
  ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_congestion_control="$cc"
  ip -n "$ns" link set "fvh$i" up
  r=$rate
  if [ -n "${FERROVOD_HOSTS_SLOW:-}" ] && [ "${FERROVOD_HOSTS_SLOW%%:*}" = "$i" ]; then
    r=${FERROVOD_HOSTS_SLOW#*:}
  fi
  if [ -n "$r" ]; then
    # what host i sends, and what it receives (the bridge's side of its link)
    # with another MTU, tbf's largest packet is its Ethernet frame (room for a VLAN tag too)
    frame=()
    [ -n "${FERROVOD_HOSTS_MTU:-}" ] && frame=(mtu $((mtu + 18)))
    ip netns exec "$ns" tc qdisc add dev "fvh$i" root handle 1: tbf rate "$r" burst 256kb latency "$queue" "${frame[@]}"
    ip netns exec fvhostsw tc qdisc add dev "fvs$i" root tbf rate "$r" burst 256kb latency "$queue" "${frame[@]}"
    if [ -n "$delay" ]; then
      ip netns exec "$ns" tc qdisc add dev "fvh$i" parent 1:1 handle 10: netem delay "$delay"
    else
      ip netns exec "$ns" tc qdisc add dev "fvh$i" parent 1:1 handle 10: bfifo limit 1mb
    fi
  fi
done
ip -n fvhostsw link set fvhostbr mtu "$mtu"
echo "emulated hosts: $n at ${rate:-unlimited}${delay:+, +$delay}${FERROVOD_HOSTS_MTU:+, MTU $mtu}, TCP $cc${FERROVOD_HOSTS_SLOW:+ (host ${FERROVOD_HOSTS_SLOW%%:*} at ${FERROVOD_HOSTS_SLOW#*:})}: $(seq -s ' ' -f '10.78.0.%g' 1 "$n")"
