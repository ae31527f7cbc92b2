# Sourced by the job scripts: the network interface gloo and NCCL open their sockets on.
#
# gloo carries every host-side collective of the learner (metrics, counts, the log-ratios of M2PO's
# global mask) and NCCL opens its bootstrap (and, without InfiniBand, its transport) on a socket.
# Left to themselves, gloo binds the address the host name resolves to (127.0.1.1 on some clusters,
# the management network on others) and NCCL the first interface it likes; the ranks of the other
# nodes may not reach either. M2PO_SOCKET_IFNAME names the interface for both; the default is the one
# this node reaches the job's last node through (`ip route get`): the network the nodes share, and
# loopback on a one-node job. Interface names must be the same on every node (srun hands this
# environment to all of them). GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME set by the caller win.

# The interface this host reaches host $1 through; empty when it cannot tell.
route_ifname() {
  local address
  address=$(getent ahostsv4 "$1" | awk 'NR == 1 {print $1}') || true
  [[ -n $address ]] || return 0
  ip -o route get "$address" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' || true
}

# Export GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for a job whose last node is $1; sets `sockets`
# to a few words for the job's first line.
set_socket_ifname() {
  local ifname=${M2PO_SOCKET_IFNAME:-$(route_ifname "$1")}
  if [[ -z $ifname ]]; then
    sockets="no route to $1 found: set M2PO_SOCKET_IFNAME"
    return 0
  fi
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
  sockets="sockets on $GLOO_SOCKET_IFNAME (gloo), $NCCL_SOCKET_IFNAME (NCCL)"
}
