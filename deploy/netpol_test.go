package deploy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// An endpoint of a flow: a pod of the output, a pod elsewhere in the
// cluster, or an address outside it.
type endpoint struct {
	name   string
	ns     string // "" outside the cluster
	labels map[string]string
	ip     netip.Addr
	ports  []corev1.ContainerPort
}

// The cluster around the output, as the policies must treat it: the
// cluster DNS, Prometheus, a pod that is a dlock client, pods that are
// not, and an address on the internet.
var others = []endpoint{
	{name: "kube-dns", ns: "kube-system", labels: map[string]string{"k8s-app": "kube-dns"}, ip: netip.MustParseAddr("10.244.9.1"),
		ports: []corev1.ContainerPort{{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP}, {Name: "dns-tcp", ContainerPort: 53, Protocol: corev1.ProtocolTCP}}},
	{name: "prometheus", ns: "monitoring", labels: map[string]string{"app": "prometheus"}, ip: netip.MustParseAddr("10.244.9.2"),
		ports: []corev1.ContainerPort{{ContainerPort: 9090, Protocol: corev1.ProtocolTCP}}},
	{name: "client", ns: "builds", labels: map[string]string{"dlock.io/client": "true"}, ip: netip.MustParseAddr("10.244.9.3")},
	{name: "stranger", ns: "builds", labels: map[string]string{"app": "builder"}, ip: netip.MustParseAddr("10.244.9.4"),
		ports: []corev1.ContainerPort{{ContainerPort: 8080, Protocol: corev1.ProtocolTCP}}},
	{name: "neighbour", ns: "dlock", labels: map[string]string{"app": "debug"}, ip: netip.MustParseAddr("10.244.9.5"),
		ports: []corev1.ContainerPort{{ContainerPort: 8080, Protocol: corev1.ProtocolTCP}}},
	{name: "internet", ip: netip.MustParseAddr("198.51.100.7"),
		ports: []corev1.ContainerPort{{ContainerPort: 443, Protocol: corev1.ProtocolTCP}}},
}

// Ports tried against every endpoint besides its own.
var probePorts = []corev1.ContainerPort{
	{ContainerPort: 22, Protocol: corev1.ProtocolTCP}, {ContainerPort: 53, Protocol: corev1.ProtocolUDP},
	{ContainerPort: 53, Protocol: corev1.ProtocolTCP}, {ContainerPort: 443, Protocol: corev1.ProtocolTCP},
	{ContainerPort: 2379, Protocol: corev1.ProtocolTCP}, {ContainerPort: 2380, Protocol: corev1.ProtocolTCP},
	{ContainerPort: 2381, Protocol: corev1.ProtocolTCP}, {ContainerPort: 6060, Protocol: corev1.ProtocolTCP},
	{ContainerPort: 7380, Protocol: corev1.ProtocolTCP},
}

// TestNetworkPolicyFlows evaluates the NetworkPolicies of each layout as
// Kubernetes does, for every pair of endpoints and every port either has
// or is tried, and compares what they let through with exactly the flows
// each layout needs. Flows between endpoints that no policy covers are
// the cluster's business and not compared.
func TestNetworkPolicyFlows(t *testing.T) {
	memory := []string{
		"dlock-content → dlock:7380/TCP",
		"client → dlock:7380/TCP",
		"prometheus → dlock:7380/TCP",
		"dlock-content → kube-dns:53/UDP",
		"dlock-content → kube-dns:53/TCP",
	}
	ha := append(slices.Clone(memory),
		"dlock → etcd:2379/TCP",
		"dlock → kube-dns:53/UDP",
		"dlock → kube-dns:53/TCP",
		"etcd → etcd:2380/TCP",
		"etcd → kube-dns:53/UDP",
		"etcd → kube-dns:53/TCP",
	)
	for _, tc := range []struct {
		dir  string
		want []string
	}{{"kubernetes", memory}, {"kubernetes/ha", ha}} {
		t.Run(tc.dir, func(t *testing.T) {
			got, err := flows(filesys.MakeFsOnDisk(), tc.dir)
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(got)
			want := slices.Sorted(slices.Values(tc.want))
			for _, f := range got {
				if !slices.Contains(want, f) {
					t.Errorf("let through, and not needed: %s", f)
				}
			}
			for _, f := range want {
				if !slices.Contains(got, f) {
					t.Errorf("needed, and not let through: %s", f)
				}
			}
		})
	}
}

// TestNetworkPolicyFlowsFail: a policy changed in one place changes the
// flows, and the comparison above sees it.
func TestNetworkPolicyFlowsFail(t *testing.T) {
	base, err := flows(filesys.MakeFsOnDisk(), "kubernetes/ha")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ file, old, new, flow string }{
		// The server let out to any pod of its namespace on 2379 (etcd's
		// own policy still keeps it off etcd's other ports).
		{"kubernetes/ha/server-networkpolicy.yaml", "        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: etcd\n              app.kubernetes.io/component: lock-state\n", "        - podSelector: {}\n", "dlock → neighbour:2379/TCP"},
		// etcd's DNS named by a label the cluster DNS does not have.
		{"kubernetes/ha/etcd-networkpolicy.yaml", "k8s-app: kube-dns", "k8s-app: coredns", "-etcd → kube-dns:53/UDP"},
		// etcd let in from any pod of its namespace.
		{"kubernetes/ha/etcd-networkpolicy.yaml", "    - from:\n        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: dlock\n              app.kubernetes.io/component: server\n", "    - from:\n        - podSelector: {}\n", "neighbour → etcd:2379/TCP"},
		// DNS from every namespace's kube-dns-labelled pods: the same flows;
		// the server let out anywhere on 53.
		{"kubernetes/ha/server-networkpolicy.yaml", "        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: kube-system\n          podSelector:\n            matchLabels:\n              k8s-app: kube-dns\n", "        - ipBlock:\n            cidr: 0.0.0.0/0\n", "dlock → internet:53/UDP"},
		// The clients' label matched in the server's namespace only.
		{"kubernetes/server/networkpolicy.yaml", "        - namespaceSelector: {}\n          podSelector:\n            matchLabels:\n              dlock.io/client: \"true\"\n", "        - podSelector:\n            matchLabels:\n              dlock.io/client: \"true\"\n", "-client → dlock:7380/TCP"},
	} {
		t.Run(tc.flow, func(t *testing.T) {
			got, err := flows(copyTree(t, "kubernetes", tc.file, tc.old, tc.new), "kubernetes/ha")
			if err != nil {
				t.Fatal(err)
			}
			// "-FLOW": a flow the change takes away.
			flow, gone := strings.CutPrefix(tc.flow, "-")
			before, after := slices.Contains(base, flow), slices.Contains(got, flow)
			if before != gone || after == gone {
				t.Fatalf("%s → %q: %s let through before: %v, after: %v", tc.file, tc.new, flow, before, after)
			}
		})
	}
}

// flows builds dir and lists the flows its NetworkPolicies let through
// that involve a pod they cover, as "SRC → DST:PORT/PROTOCOL".
func flows(fsys filesys.FileSystem, dir string) ([]string, error) {
	objs, err := build(fsys, dir)
	if err != nil {
		return nil, err
	}
	var pods []endpoint
	add := func(name, ns string, tmpl corev1.PodTemplateSpec) {
		e := endpoint{name: name, ns: ns, labels: tmpl.Labels, ip: netip.AddrFrom4([4]byte{10, 244, 1, byte(len(pods) + 1)})}
		for _, c := range tmpl.Spec.Containers {
			e.ports = append(e.ports, c.Ports...)
		}
		pods = append(pods, e)
	}
	for _, d := range of[*appsv1.Deployment](objs) {
		add(d.Name, d.Namespace, d.Spec.Template)
	}
	for _, d := range of[*appsv1.DaemonSet](objs) {
		add(d.Name, d.Namespace, d.Spec.Template)
	}
	for _, s := range of[*appsv1.StatefulSet](objs) {
		add(s.Name, s.Namespace, s.Spec.Template)
	}
	policies := of[*networkingv1.NetworkPolicy](objs)
	all := append(slices.Clone(pods), others...)
	var out []string
	for _, src := range all {
		for _, dst := range all {
			if !slices.ContainsFunc(pods, func(p endpoint) bool { return p.name == src.name || p.name == dst.name }) {
				continue
			}
			for _, port := range append(slices.Clone(dst.ports), probePorts...) {
				f := fmt.Sprintf("%s → %s:%d/%s", src.name, dst.name, port.ContainerPort, port.Protocol)
				if slices.Contains(out, f) {
					continue
				}
				if allowed(policies, src, dst, port) {
					out = append(out, f)
				}
			}
		}
	}
	return out, nil
}

// allowed is Kubernetes' rule: a pod that a policy of its namespace selects
// for a direction is isolated in it, and then a flow must match a rule of
// one of those policies; both the source's egress and the destination's
// ingress must let the flow through. Addresses outside the cluster are
// never isolated.
func allowed(policies []*networkingv1.NetworkPolicy, src, dst endpoint, port corev1.ContainerPort) bool {
	return direction(policies, src, dst, port, networkingv1.PolicyTypeEgress) &&
		direction(policies, dst, src, port, networkingv1.PolicyTypeIngress)
}

// direction: does the side pod let the flow with peer through, on the
// destination port, in the direction given?
func direction(policies []*networkingv1.NetworkPolicy, side, peer endpoint, port corev1.ContainerPort, typ networkingv1.PolicyType) bool {
	if side.ns == "" {
		return true
	}
	// The destination, whose named ports the rules may use.
	dst := peer
	if typ == networkingv1.PolicyTypeIngress {
		dst = side
	}
	isolated := false
	for _, np := range policies {
		sel, err := metav1Selector(&np.Spec.PodSelector)
		if err != nil || np.Namespace != side.ns || !sel.Matches(labels.Set(side.labels)) || !slices.Contains(policyTypes(np), typ) {
			continue
		}
		isolated = true
		if typ == networkingv1.PolicyTypeIngress {
			for _, r := range np.Spec.Ingress {
				if peersMatch(np.Namespace, r.From, peer) && portsMatch(r.Ports, dst, port) {
					return true
				}
			}
		} else {
			for _, r := range np.Spec.Egress {
				if peersMatch(np.Namespace, r.To, peer) && portsMatch(r.Ports, dst, port) {
					return true
				}
			}
		}
	}
	return !isolated
}

// policyTypes are a policy's directions; without policyTypes, Ingress and,
// if it has egress rules, Egress.
func policyTypes(np *networkingv1.NetworkPolicy) []networkingv1.PolicyType {
	if len(np.Spec.PolicyTypes) > 0 {
		return np.Spec.PolicyTypes
	}
	t := []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
	if len(np.Spec.Egress) > 0 {
		t = append(t, networkingv1.PolicyTypeEgress)
	}
	return t
}

func peersMatch(ns string, peers []networkingv1.NetworkPolicyPeer, e endpoint) bool {
	if len(peers) == 0 {
		return true
	}
	for _, p := range peers {
		if p.IPBlock != nil {
			cidr, err := netip.ParsePrefix(p.IPBlock.CIDR)
			if err != nil || !cidr.Contains(e.ip) {
				continue
			}
			excluded := false
			for _, x := range p.IPBlock.Except {
				if x, err := netip.ParsePrefix(x); err == nil && x.Contains(e.ip) {
					excluded = true
				}
			}
			if !excluded {
				return true
			}
			continue
		}
		if e.ns == "" {
			continue
		}
		if p.NamespaceSelector != nil {
			sel, err := metav1Selector(p.NamespaceSelector)
			if err != nil || !sel.Matches(labels.Set{"kubernetes.io/metadata.name": e.ns}) {
				continue
			}
		} else if e.ns != ns {
			continue
		}
		if p.PodSelector != nil {
			sel, err := metav1Selector(p.PodSelector)
			if err != nil || !sel.Matches(labels.Set(e.labels)) {
				continue
			}
		}
		return true
	}
	return false
}

func portsMatch(ports []networkingv1.NetworkPolicyPort, dst endpoint, port corev1.ContainerPort) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		proto := corev1.ProtocolTCP
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		if proto != port.Protocol {
			continue
		}
		if p.Port == nil {
			return true
		}
		if p.Port.Type == intstr.String {
			// A named port is the destination's port of that name.
			for _, cp := range dst.ports {
				if cp.Name == p.Port.StrVal && cp.ContainerPort == port.ContainerPort && cp.Protocol == port.Protocol {
					return true
				}
			}
			continue
		}
		end := p.Port.IntVal
		if p.EndPort != nil {
			end = *p.EndPort
		}
		if port.ContainerPort >= p.Port.IntVal && port.ContainerPort <= end {
			return true
		}
	}
	return false
}
