#!/bin/sh
# mkcerts.sh DIR [NODE...] — the certificates of a dlock deployment with
# mTLS, made with openssl (docs/SECURITY.md, "Turning identities on", walks
# through them; tests in cmd/dlock and deploy run this script and serve with
# what it makes). DIR is the operator's: it keeps the CA's key.
#
#   DIR/ca.crt, DIR/ca.key          a CA for dlock alone (made once; an
#                                   existing one is reused, so running the
#                                   script again rotates the other files),
#                                   named $DLOCK_CA_NAME (default "dlock CA")
#   DIR/server.crt, DIR/server.key  the server's certificate, for the names
#                                   in $DLOCK_SERVER_SANS (default
#                                   DNS:localhost,IP:127.0.0.1,IP:::1) and
#                                   the extended key usages in
#                                   $DLOCK_SERVER_USAGE (default serverAuth)
#   DIR/NODE.crt, DIR/NODE.key      one client certificate per node: its
#                                   Subject CN and its DNS SAN are the node
#                                   id; the node id "*" makes an operator's
#                                   certificate (file names op.crt, op.key)
#
# Serve:   copy ca.crt, server.crt and server.key (never ca.key) to a
#          directory of the server's, PKI, each mode 0600, then
#          dlock serve --tls-cert PKI/server.crt --tls-key PKI/server.key \
#                      --client-ca PKI/ca.crt
# Rotate:  run the script again, copy the new files, kill -HUP the server.
#
# The same script makes the certificates of an etcd cluster that dlock
# servers use (deploy/README.md), with a CA of its own, which must not be
# dlock's: etcd lets in any client certificate its CA signed. Its members
# connect to each other too, so their certificate is also a client's:
#
#   DLOCK_CA_NAME='dlock etcd CA' DLOCK_SERVER_USAGE=serverAuth,clientAuth \
#   DLOCK_SERVER_SANS=IP:10.0.0.1,IP:10.0.0.2,IP:10.0.0.3 \
#       sh docs/mkcerts.sh DIR dlock
#
# makes the members' certificate (server.crt) and the dlock servers'
# client certificate for etcd (dlock.crt).
set -eu

dir=${1:?usage: mkcerts.sh DIR [NODE...]}
shift
days=${DLOCK_CERT_DAYS:-365}
sans=${DLOCK_SERVER_SANS:-DNS:localhost,IP:127.0.0.1,IP:::1}
usage=${DLOCK_SERVER_USAGE:-serverAuth}
ca_name=${DLOCK_CA_NAME:-dlock CA}
mkdir -p "$dir"
umask 077 # keys readable by their owner only

# The CA. Keep ca.key off the servers and nodes: whoever holds it can make
# a certificate for any node, or an operator's.
if [ ! -f "$dir/ca.key" ]; then
	openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
		-days 3650 -subj "/CN=$ca_name" -keyout "$dir/ca.key" -out "$dir/ca.crt" \
		-addext "basicConstraints=critical,CA:TRUE" \
		-addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

# issue NAME CN EXTENSIONS: a P-256 key and a certificate signed by the CA.
# Both are written next to their final names and renamed into place, so a
# server reloading on SIGHUP never reads half a file.
issue() {
	name=$1 cn=$2 ext=$3
	printf '%s\n' "$ext" >"$dir/$name.ext"
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
		-subj "/CN=$cn" -keyout "$dir/$name.key.new" -out "$dir/$name.csr" 2>/dev/null
	openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
		-CAcreateserial -days "$days" -sha256 -extfile "$dir/$name.ext" \
		-out "$dir/$name.crt.new" 2>/dev/null
	rm -f "$dir/$name.csr" "$dir/$name.ext"
	mv "$dir/$name.key.new" "$dir/$name.key"
	mv "$dir/$name.crt.new" "$dir/$name.crt"
}

issue server localhost "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=$usage
subjectAltName=$sans"

for node in "$@"; do
	name=$node
	[ "$node" = "*" ] && name=op
	issue "$name" "$node" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth
subjectAltName=DNS:$node"
done
