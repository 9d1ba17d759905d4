package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	srvconfig "github.com/containerd/containerd/v2/cmd/containerd/server/config"
	"github.com/pelletier/go-toml/v2"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	kusttypes "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// The kustomizations a user may build, each checked on its own: the whole
// (kubernetes/), its two parts (a cluster that runs dlock-content from
// systemd on the hosts builds only server/), and the overlay on etcd (ha/).
type kustomizationCase struct {
	dir       string
	namespace string   // every namespaced object's, "" for none
	kinds     []string // exactly the kinds of the output
}

var kustomizations = []kustomizationCase{
	{"kubernetes", "dlock", []string{"ConfigMap", "DaemonSet", "Deployment", "Namespace", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"}},
	{"kubernetes/server", "", []string{"Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"}},
	{"kubernetes/content", "", []string{"ConfigMap", "DaemonSet", "NetworkPolicy", "PersistentVolumeClaim"}},
	{"kubernetes/ha", "dlock", []string{"ConfigMap", "DaemonSet", "Deployment", "Namespace", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "StatefulSet"}},
}

// scheme knows the API types the manifests may use, and only those: any
// other kind or apiVersion is an error.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, networkingv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// decodeStrict decodes one Kubernetes object into its typed API struct. An
// unknown or misspelled field, a duplicate field, or a value of the wrong
// type is an error, as is a kind the scheme does not know.
func decodeStrict(doc []byte) (runtime.Object, error) {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	gv, err := schema.ParseGroupVersion(tm.APIVersion)
	if err != nil {
		return nil, err
	}
	obj, err := scheme.New(gv.WithKind(tm.Kind))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", tm.APIVersion, tm.Kind, err)
	}
	// sigs.k8s.io/yaml's own UnmarshalStrict ends in encoding/json, which
	// matches field names regardless of case: it takes mountpath for
	// mountPath. The API server does not (kubectl apply warns "unknown
	// field" and drops it), so decode as it does: case-sensitive.
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	strict, err := sigsjson.UnmarshalStrict(js, obj, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	if len(strict) > 0 {
		return nil, fmt.Errorf("%s: %w", tm.Kind, errors.Join(strict...))
	}
	return obj, nil
}

// build runs kustomize on dir and decodes every resource of the output.
func build(fsys filesys.FileSystem, dir string) ([]runtime.Object, error) {
	rm, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	var objs []runtime.Object
	var errs []error
	for _, r := range rm.Resources() {
		doc, err := r.AsYAML()
		if err != nil {
			return nil, err
		}
		obj, err := decodeStrict(doc)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %s: %w", r.GetKind(), r.GetName(), err))
			continue
		}
		objs = append(objs, obj)
	}
	return objs, errors.Join(errs...)
}

func of[T runtime.Object](objs []runtime.Object) []T {
	var out []T
	for _, o := range objs {
		if t, ok := o.(T); ok {
			out = append(out, t)
		}
	}
	return out
}

// check builds one kustomization and checks what matters of its output.
// Every test below, and every typo the typo test makes, goes through it.
func check(fsys filesys.FileSystem, dir, namespace string, kinds []string, env knownEnv) error {
	objs, err := build(fsys, dir)
	if err != nil {
		return err
	}
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	var got []string
	for _, o := range objs {
		k := kindOf(o)
		if !slices.Contains(got, k) {
			got = append(got, k)
		}
		m := metaOf(o)
		if k != "Namespace" && m.GetNamespace() != namespace {
			fail("%s %s: namespace %q, want %q", k, m.GetName(), m.GetNamespace(), namespace)
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, kinds) {
		fail("kinds %v, want %v", got, kinds)
	}

	pvcs := map[string]*corev1.PersistentVolumeClaim{}
	for _, p := range of[*corev1.PersistentVolumeClaim](objs) {
		pvcs[p.Name] = p
	}
	var pods []pod
	for _, d := range of[*appsv1.Deployment](objs) {
		pods = append(pods, pod{"Deployment " + d.Name, &d.Spec.Template.Spec, d.Spec.Template.Labels, nil})
		checkSelector(fail, "Deployment "+d.Name, d.Spec.Selector, d.Spec.Template.Labels)
	}
	for _, d := range of[*appsv1.DaemonSet](objs) {
		pods = append(pods, pod{"DaemonSet " + d.Name, &d.Spec.Template.Spec, d.Spec.Template.Labels, nil})
		checkSelector(fail, "DaemonSet "+d.Name, d.Spec.Selector, d.Spec.Template.Labels)
	}
	for _, s := range of[*appsv1.StatefulSet](objs) {
		var claims []string
		for _, c := range s.Spec.VolumeClaimTemplates {
			claims = append(claims, c.Name)
		}
		pods = append(pods, pod{"StatefulSet " + s.Name, &s.Spec.Template.Spec, s.Spec.Template.Labels, claims})
		checkSelector(fail, "StatefulSet "+s.Name, s.Spec.Selector, s.Spec.Template.Labels)
	}
	for _, p := range pods {
		checkPod(fail, p.owner, p.spec, p.claims, pvcs, namespace != "")
	}

	services := of[*corev1.Service](objs)
	pdbs := of[*policyv1.PodDisruptionBudget](objs)
	for _, d := range of[*appsv1.Deployment](objs) {
		checkServer(fail, d, pvcs, of[*appsv1.StatefulSet](objs), services, pdbs, env)
	}
	for _, d := range of[*appsv1.DaemonSet](objs) {
		checkContent(fail, d, pvcs, services, of[*corev1.ConfigMap](objs), env)
	}
	for _, st := range of[*appsv1.StatefulSet](objs) {
		checkEtcd(fail, st, services, pdbs, env)
	}

	// Every selector must select a pod of this output, and every port it
	// names must be one of that pod's.
	podsOf := func(sel labels.Selector) []pod { return podsMatching(pods, sel) }
	for _, s := range services {
		sel := labels.SelectorFromSet(s.Spec.Selector)
		matched := podsOf(sel)
		if len(s.Spec.Selector) == 0 || len(matched) == 0 {
			fail("Service %s: selector %v selects no pod", s.Name, s.Spec.Selector)
		}
		for _, sp := range s.Spec.Ports {
			for _, p := range matched {
				if !hasPort(p.spec, sp.TargetPort) {
					fail("Service %s: targetPort %s is no port of %s", s.Name, sp.TargetPort.String(), p.owner)
				}
			}
		}
	}
	for _, b := range of[*policyv1.PodDisruptionBudget](objs) {
		sel, err := metav1Selector(b.Spec.Selector)
		if err != nil || len(podsOf(sel)) == 0 {
			fail("PodDisruptionBudget %s: selects no pod (%v)", b.Name, err)
		}
		if b.Spec.MinAvailable == nil && b.Spec.MaxUnavailable == nil {
			fail("PodDisruptionBudget %s: neither minAvailable nor maxUnavailable", b.Name)
		}
	}
	for _, np := range of[*networkingv1.NetworkPolicy](objs) {
		sel, err := metav1Selector(&np.Spec.PodSelector)
		matched := podsOf(sel)
		if err != nil || len(np.Spec.PodSelector.MatchLabels) == 0 || len(matched) == 0 {
			fail("NetworkPolicy %s: podSelector selects no pod of this output (%v)", np.Name, err)
		}
		if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) {
			fail("NetworkPolicy %s: does not restrict Ingress", np.Name)
		}
		for _, rule := range np.Spec.Ingress {
			for _, port := range rule.Ports {
				for _, p := range matched {
					if port.Port != nil && !hasPort(p.spec, *port.Port) {
						fail("NetworkPolicy %s: port %s is no port of %s", np.Name, port.Port.String(), p.owner)
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

type pod struct {
	owner  string
	spec   *corev1.PodSpec
	meta   map[string]string // labels
	claims []string          // a StatefulSet's volumeClaimTemplates
}

func podsMatching(pods []pod, sel labels.Selector) []pod {
	var out []pod
	for _, p := range pods {
		if sel.Matches(labels.Set(p.meta)) {
			out = append(out, p)
		}
	}
	return out
}

func checkSelector(fail func(string, ...any), owner string, sel *metav1LabelSelector, podLabels map[string]string) {
	s, err := metav1Selector(sel)
	if err != nil || sel == nil || len(sel.MatchLabels) == 0 || !s.Matches(labels.Set(podLabels)) {
		fail("%s: selector does not select its own pod template (%v)", owner, err)
	}
}

// checkPod: what every pod of dlock must have, whatever it runs.
func checkPod(fail func(string, ...any), owner string, spec *corev1.PodSpec, claims []string, pvcs map[string]*corev1.PersistentVolumeClaim, imagesSet bool) {
	if spec.EnableServiceLinks == nil || *spec.EnableServiceLinks {
		// A Service named dlock injects DLOCK_PORT and friends, in the
		// DLOCK_ namespace that dlock reads its configuration from.
		fail("%s: enableServiceLinks must be false", owner)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		fail("%s: automountServiceAccountToken must be false (dlock never talks to the API server)", owner)
	}
	psc := spec.SecurityContext
	if psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		fail("%s: pod securityContext.seccompProfile must be RuntimeDefault", owner)
	}
	if psc != nil && psc.RunAsNonRoot != nil && *psc.RunAsNonRoot && psc.RunAsUser != nil && *psc.RunAsUser == 0 {
		fail("%s: runAsNonRoot with runAsUser 0 never starts", owner)
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
		if c := v.PersistentVolumeClaim; c != nil && pvcs[c.ClaimName] == nil {
			fail("%s: volume %s: no PersistentVolumeClaim %s in the output", owner, v.Name, c.ClaimName)
		}
	}
	if len(spec.InitContainers) > 0 {
		fail("%s: init containers are not checked here; check them before adding one", owner)
	}
	for _, c := range spec.Containers {
		where := owner + " container " + c.Name
		if imagesSet && !strings.Contains(c.Image, "/") {
			fail("%s: image %q was not set by the kustomization's images:", where, c.Image)
		}
		sc := c.SecurityContext
		if sc == nil {
			fail("%s: no securityContext", where)
			continue
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			fail("%s: readOnlyRootFilesystem must be true", where)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			fail("%s: allowPrivilegeEscalation must be false", where)
		}
		if sc.Privileged != nil && *sc.Privileged {
			fail("%s: privileged", where)
		}
		if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
			fail("%s: capabilities must drop ALL and add none", where)
		}
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, lim := c.Resources.Requests[r], c.Resources.Limits[r]
			if req.IsZero() || lim.IsZero() {
				fail("%s: resources: %s request and limit must be set", where, r)
			} else if req.Cmp(lim) > 0 {
				fail("%s: resources: %s request above its limit", where, r)
			}
		}
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok && !slices.Contains(claims, m.Name) {
				fail("%s: volumeMount %s names no volume", where, m.Name)
			}
		}
	}
}

// checkServer: the dlock server's Deployment, on the memory backend (one
// replica) or on etcd (several, with the etcd of the same output).
func checkServer(fail func(string, ...any), d *appsv1.Deployment, pvcs map[string]*corev1.PersistentVolumeClaim, etcds []*appsv1.StatefulSet, services []*corev1.Service, pdbs []*policyv1.PodDisruptionBudget, env knownEnv) {
	where := "Deployment " + d.Name
	spec := &d.Spec.Template.Spec
	if psc := spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		fail("%s: the server must run as non-root", where)
	}
	if len(spec.Containers) != 1 {
		fail("%s: want one container, got %d", where, len(spec.Containers))
		return
	}
	c := spec.Containers[0]
	if len(c.Args) == 0 || c.Args[0] != "serve" {
		fail("%s: args must start with serve, got %q", where, c.Args)
	}
	vars := envOf(c)
	env.check(fail, where, "dlock", vars)
	flags := flagsOf(c.Args, vars, "DLOCK")
	if flags["refcount"] != "server" {
		fail("%s: --refcount=server is needed (dlock-content refuses to start without it), got %q", where, flags["refcount"])
	}
	switch b := flags["backend"]; b {
	case "", "memory":
		// The memory backend keeps all lock state in one process: two
		// replicas would be two lock services, and an update must not
		// overlap them.
		if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 {
			fail("%s: replicas must be 1 on the memory backend", where)
		}
		if d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
			fail("%s: strategy must be Recreate (never two servers at once)", where)
		}
		// refcount.db must outlive the pod.
		if v := volumeAt(spec, c, flags["data-dir"]); v == nil || v.PersistentVolumeClaim == nil {
			fail("%s: --data-dir %q is not on a PersistentVolumeClaim", where, flags["data-dir"])
		} else if p := pvcs[v.PersistentVolumeClaim.ClaimName]; p != nil && !slices.Contains(p.Spec.AccessModes, corev1.ReadWriteOnce) {
			fail("%s: the data PersistentVolumeClaim should be ReadWriteOnce", where)
		}
	case "etcd":
		checkServerOnEtcd(fail, where, d, flags, etcds, services, pdbs)
	default:
		fail("%s: backend %q: dlock has memory and etcd", where, b)
	}
	host, port, err := net.SplitHostPort(flags["listen"])
	if err != nil || (host != "0.0.0.0" && host != "" && host != "::") {
		fail("%s: --listen %q: the Service cannot reach anything but 0.0.0.0:PORT (%v)", where, flags["listen"], err)
	}
	// Identities: a token file and HTTPS, each file from a Secret mounted
	// read-only.
	for _, f := range []string{"token-file", "tls-cert", "tls-key", "client-ca", "etcd-ca", "etcd-cert", "etcd-key"} {
		if flags[f] == "" {
			if f == "token-file" || f == "tls-cert" || f == "tls-key" {
				fail("%s: no --%s: identities must be on (docs/SECURITY.md)", where, f)
			}
			continue
		}
		checkSecretFile(fail, where, spec, c, "--"+f, flags[f])
	}
	scheme := corev1.URISchemeHTTP
	if flags["tls-cert"] != "" {
		scheme = corev1.URISchemeHTTPS
	}
	apiPort := containerPort(c, port)
	if apiPort == nil {
		fail("%s: the listen port %q is not a containerPort", where, port)
	} else {
		// Readiness takes a server that cannot serve (draining, or on
		// etcd without a quorum) out of the Service; liveness restarts
		// only a process that does not answer (docs/API.md).
		for name, pp := range map[string]struct {
			p    *corev1.Probe
			path string
		}{"readinessProbe": {c.ReadinessProbe, "/readyz"}, "livenessProbe": {c.LivenessProbe, "/healthz"}} {
			if p := pp.p; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != pp.path || !portIs(p.HTTPGet.Port, apiPort) || schemeOf(p.HTTPGet) != scheme {
				fail("%s: %s must be GET %s on port %d over %s", where, name, pp.path, apiPort.ContainerPort, scheme)
			}
		}
		a := d.Spec.Template.Annotations
		if a["prometheus.io/scrape"] != "true" || a["prometheus.io/path"] != "/metrics" || a["prometheus.io/port"] != strconv.Itoa(int(apiPort.ContainerPort)) ||
			!strings.EqualFold(a["prometheus.io/scheme"], string(scheme)) {
			fail("%s: Prometheus annotations must scrape /metrics on port %d over %s, got %v", where, apiPort.ContainerPort, scheme, a)
		}
	}
}

func schemeOf(g *corev1.HTTPGetAction) corev1.URIScheme {
	if g.Scheme == "" {
		return corev1.URISchemeHTTP
	}
	return g.Scheme
}

// checkSecretFile: a file a flag names is in a Secret volume, mounted
// read-only, as one of the Secret's keys.
func checkSecretFile(fail func(string, ...any), where string, spec *corev1.PodSpec, c corev1.Container, flag, p string) {
	v := volumeAt(spec, c, p)
	if v == nil || v.Secret == nil {
		fail("%s: %s %q is not in a Secret volume", where, flag, p)
		return
	}
	for _, m := range c.VolumeMounts {
		if m.Name == v.Name && !m.ReadOnly {
			fail("%s: the Secret %s is mounted read-write at %s", where, v.Secret.SecretName, m.MountPath)
		}
	}
	if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o007 != 0 {
		fail("%s: the Secret %s: defaultMode must give others nothing", where, v.Secret.SecretName)
	}
}

// secretKeys is, per Secret a pod mounts, the keys its files name.
func secretKeys(spec *corev1.PodSpec, c corev1.Container, vars map[string]corev1.EnvVar) map[string][]string {
	out := map[string][]string{}
	for _, e := range vars {
		if e.ValueFrom != nil || !strings.HasPrefix(e.Value, "/") {
			continue
		}
		v := volumeAt(spec, c, e.Value)
		if v == nil || v.Secret == nil {
			continue
		}
		key := path.Base(e.Value)
		for _, it := range v.Secret.Items {
			if path.Base(it.Path) == key {
				key = it.Key
			}
		}
		if !slices.Contains(out[v.Secret.SecretName], key) {
			out[v.Secret.SecretName] = append(out[v.Secret.SecretName], key)
		}
	}
	return out
}

// checkServerOnEtcd: several servers, one per node, kept by a budget, that
// reach every member of the etcd of this output over TLS.
func checkServerOnEtcd(fail func(string, ...any), where string, d *appsv1.Deployment, flags map[string]string, etcds []*appsv1.StatefulSet, services []*corev1.Service, pdbs []*policyv1.PodDisruptionBudget) {
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 3 {
		fail("%s: on etcd, run 3 replicas or more", where)
	}
	if d.Spec.Strategy.Type != appsv1.RollingUpdateDeploymentStrategyType {
		fail("%s: on etcd the strategy is RollingUpdate: the servers are one service", where)
	}
	checkAntiAffinity(fail, where, &d.Spec.Template.Spec, d.Spec.Template.Labels)
	if ru := d.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxSurge == nil || ru.MaxSurge.IntValue() != 0 {
		fail("%s: maxSurge must be 0: with one server per node required, a surge pod finds no node", where)
	}
	checkBudget(fail, where, d.Spec.Template.Labels, pdbs)
	if flags["etcd-ca"] == "" || flags["etcd-cert"] == "" || flags["etcd-key"] == "" {
		fail("%s: --etcd-ca, --etcd-cert and --etcd-key are needed: etcd wants client certificates", where)
	}
	if len(etcds) != 1 {
		fail("%s: on etcd, want the etcd StatefulSet in this output, found %d", where, len(etcds))
		return
	}
	st := etcds[0]
	clientPort := containerPort(st.Spec.Template.Spec.Containers[0], "2379")
	want := map[string]bool{}
	for i := range int(ptrOr(st.Spec.Replicas, 1)) {
		want[fmt.Sprintf("%s-%d.%s", st.Name, i, st.Spec.ServiceName)] = true
	}
	seen := map[string]bool{}
	for _, ep := range strings.Split(flags["etcd-endpoints"], ",") {
		u, err := url.Parse(ep)
		if err != nil || u.Scheme != "https" || !want[u.Hostname()] || clientPort == nil || u.Port() != strconv.Itoa(int(clientPort.ContainerPort)) {
			fail("%s: --etcd-endpoints: %q is not https://MEMBER.%s:2379 of a member of StatefulSet %s", where, ep, st.Spec.ServiceName, st.Name)
			continue
		}
		seen[u.Hostname()] = true
	}
	if len(seen) != len(want) {
		fail("%s: --etcd-endpoints names %d of the %d members", where, len(seen), len(want))
	}
}

func ptrOr[T any](p *T, v T) T {
	if p == nil {
		return v
	}
	return *p
}

// checkAntiAffinity: never two of these pods on one node.
func checkAntiAffinity(fail func(string, ...any), where string, spec *corev1.PodSpec, own map[string]string) {
	ok := false
	if a := spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		for _, t := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
			sel, err := metav1Selector(t.LabelSelector)
			if err == nil && t.TopologyKey == "kubernetes.io/hostname" && sel.Matches(labels.Set(own)) && !sel.Empty() {
				ok = true
			}
		}
	}
	if !ok {
		fail("%s: needs a required pod anti-affinity on kubernetes.io/hostname against its own pods", where)
	}
}

// checkBudget: a PodDisruptionBudget covers these pods and lets a drain
// take at most one.
func checkBudget(fail func(string, ...any), where string, own map[string]string, pdbs []*policyv1.PodDisruptionBudget) {
	for _, b := range pdbs {
		sel, err := metav1Selector(b.Spec.Selector)
		if err != nil || !sel.Matches(labels.Set(own)) {
			continue
		}
		if b.Spec.MaxUnavailable != nil && b.Spec.MaxUnavailable.IntValue() == 1 {
			return
		}
		fail("%s: PodDisruptionBudget %s must be maxUnavailable: 1", where, b.Name)
		return
	}
	fail("%s: no PodDisruptionBudget covers its pods", where)
}

// checkEtcd: the etcd cluster of the etcd layout, as Debian's etcd (the
// version make deps installs) reads its variables.
func checkEtcd(fail func(string, ...any), st *appsv1.StatefulSet, services []*corev1.Service, pdbs []*policyv1.PodDisruptionBudget, env knownEnv) {
	where := "StatefulSet " + st.Name
	n := int(ptrOr(st.Spec.Replicas, 1))
	if n < 3 || n%2 == 0 {
		fail("%s: replicas %d: an etcd cluster needs an odd number, 3 or more", where, n)
	}
	if st.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		fail("%s: podManagementPolicy must be Parallel: a member is ready only with a quorum", where)
	}
	var headless *corev1.Service
	for _, s := range services {
		if s.Name == st.Spec.ServiceName {
			headless = s
		}
	}
	if headless == nil || headless.Spec.ClusterIP != corev1.ClusterIPNone || !headless.Spec.PublishNotReadyAddresses {
		fail("%s: serviceName %q must be a headless Service of this output that publishes members not ready yet", where, st.Spec.ServiceName)
	}
	spec := &st.Spec.Template.Spec
	checkAntiAffinity(fail, where, spec, st.Spec.Template.Labels)
	checkBudget(fail, where, st.Spec.Template.Labels, pdbs)
	if psc := spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		fail("%s: etcd must run as non-root", where)
	}
	if len(spec.Containers) != 1 {
		fail("%s: want one container, got %d", where, len(spec.Containers))
		return
	}
	c := spec.Containers[0]
	vars := envOf(c)
	if env["etcd"] != nil {
		for name := range vars {
			if strings.HasPrefix(name, "ETCD_") && !env["etcd"][name] {
				fail("%s: etcd reads no variable %s", where, name)
			}
		}
	}
	val := func(k string) string { return vars[k].Value }
	if v := vars["ETCD_NAME"]; v.ValueFrom == nil || v.ValueFrom.FieldRef == nil || v.ValueFrom.FieldRef.FieldPath != "metadata.name" {
		fail("%s: ETCD_NAME must be the pod's name", where)
	}
	svc := st.Spec.ServiceName
	var members []string
	for i := range n {
		members = append(members, fmt.Sprintf("%s-%d=https://%s-%d.%s:2380", st.Name, i, st.Name, i, svc))
	}
	if got := val("ETCD_INITIAL_CLUSTER"); got != strings.Join(members, ",") {
		fail("%s: ETCD_INITIAL_CLUSTER=%s, want %s", where, got, strings.Join(members, ","))
	}
	for k, want := range map[string]string{
		"ETCD_INITIAL_ADVERTISE_PEER_URLS": "https://$(ETCD_NAME)." + svc + ":2380",
		"ETCD_ADVERTISE_CLIENT_URLS":       "https://$(ETCD_NAME)." + svc + ":2379",
		"ETCD_LISTEN_PEER_URLS":            "https://0.0.0.0:2380",
		"ETCD_LISTEN_CLIENT_URLS":          "https://0.0.0.0:2379",
		"ETCD_INITIAL_CLUSTER_STATE":       "new",
		"ETCD_CLIENT_CERT_AUTH":            "true",
		"ETCD_PEER_CLIENT_CERT_AUTH":       "true",
	} {
		if val(k) != want {
			fail("%s: %s=%q, want %q", where, k, val(k), want)
		}
	}
	for _, k := range []string{"ETCD_TRUSTED_CA_FILE", "ETCD_CERT_FILE", "ETCD_KEY_FILE", "ETCD_PEER_TRUSTED_CA_FILE", "ETCD_PEER_CERT_FILE", "ETCD_PEER_KEY_FILE"} {
		checkSecretFile(fail, where, spec, c, k, val(k))
	}
	data := val("ETCD_DATA_DIR")
	onClaim := false
	for _, m := range c.VolumeMounts {
		if rel, err := filepath.Rel(m.MountPath, data); err == nil && !strings.HasPrefix(rel, "..") {
			for _, t := range st.Spec.VolumeClaimTemplates {
				onClaim = onClaim || t.Name == m.Name
			}
		}
	}
	if !onClaim {
		fail("%s: ETCD_DATA_DIR %q is not on a volumeClaimTemplate", where, data)
	}
	metrics := containerPort(c, "2381")
	for name, p := range map[string]*corev1.Probe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || !strings.HasPrefix(p.HTTPGet.Path, "/health") || metrics == nil || !portIs(p.HTTPGet.Port, metrics) {
			fail("%s: %s must be GET /health on the metrics port 2381", where, name)
		}
	}
	if val("ETCD_LISTEN_METRICS_URLS") != "http://0.0.0.0:2381" {
		fail("%s: ETCD_LISTEN_METRICS_URLS must be http://0.0.0.0:2381, where the probes go", where)
	}
}

// checkContent: dlock-content's DaemonSet, its containerd drop-in, and the
// server it talks to.
func checkContent(fail func(string, ...any), d *appsv1.DaemonSet, pvcs map[string]*corev1.PersistentVolumeClaim, services []*corev1.Service, cms []*corev1.ConfigMap, env knownEnv) {
	where := "DaemonSet " + d.Name
	spec := &d.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		fail("%s: want one container, got %d", where, len(spec.Containers))
		return
	}
	c := spec.Containers[0]
	vars := envOf(c)
	env.check(fail, where, "dlock-content", vars)
	flags := flagsOf(c.Args, vars, "DLOCK_CONTENT")

	if v, ok := vars["DLOCK_CONTENT_NODE"]; !ok || v.ValueFrom == nil || v.ValueFrom.FieldRef == nil || v.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		fail("%s: DLOCK_CONTENT_NODE must come from spec.nodeName (the pod's host name is not the node's)", where)
	}
	root := flags["root"]
	if v := volumeAt(spec, c, root); v == nil || v.PersistentVolumeClaim == nil {
		fail("%s: --root %q is not on a PersistentVolumeClaim", where, root)
	} else if p := pvcs[v.PersistentVolumeClaim.ClaimName]; p != nil && !slices.Contains(p.Spec.AccessModes, corev1.ReadWriteMany) {
		fail("%s: the shared store's PersistentVolumeClaim must be ReadWriteMany (every node mounts it)", where)
	}

	// The socket must be in a host directory, and the drop-in must name
	// it as the host's containerd sees it.
	sock := flags["socket"]
	hostSock := ""
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, sock)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil {
				hostSock = path.Join(v.HostPath.Path, rel)
			}
		}
	}
	if hostSock == "" {
		fail("%s: --socket %q is not in a hostPath volume: the node's containerd cannot reach it", where, sock)
	}

	// Identities: https, the server's CA and the node's own token (and
	// certificate, with mTLS) from the host, read-only.
	if !strings.HasPrefix(flags["server"], "https://") {
		fail("%s: --server %q: the server speaks https", where, flags["server"])
	}
	for _, f := range []string{"ca", "token-file", "cert", "key"} {
		p := flags[f]
		if p == "" {
			if f == "ca" || f == "token-file" {
				fail("%s: no --%s", where, f)
			}
			continue
		}
		v := volumeAt(spec, c, p)
		ro := false
		for _, m := range c.VolumeMounts {
			if v != nil && m.Name == v.Name {
				ro = m.ReadOnly
			}
		}
		if v == nil || v.HostPath == nil || !ro {
			fail("%s: --%s %q is not in a read-only hostPath volume (the node's own credentials)", where, f, p)
		}
	}
	if (flags["cert"] == "") != (flags["key"] == "") {
		fail("%s: --cert and --key go together", where)
	}

	// The server URL must name a Service of this output and its port.
	if len(services) > 0 {
		u, err := url.Parse(flags["server"])
		found := false
		if err == nil {
			for _, s := range services {
				for _, p := range s.Spec.Ports {
					if (u.Hostname() == s.Name || strings.HasPrefix(u.Hostname(), s.Name+"."+s.Namespace+".")) && u.Port() == strconv.Itoa(int(p.Port)) {
						found = true
					}
				}
			}
		}
		if !found {
			fail("%s: --server %q is no Service port of this output (%v)", where, flags["server"], err)
		}
	}

	var dropIn *corev1.ConfigMap
	for _, cm := range cms {
		if _, ok := cm.Data["dlock.toml"]; ok {
			dropIn = cm
		}
	}
	if dropIn == nil {
		fail("%s: no ConfigMap with the containerd drop-in dlock.toml", where)
		return
	}
	if err := checkDropIn([]byte(dropIn.Data["dlock.toml"]), hostSock); err != nil {
		fail("ConfigMap %s: dlock.toml: %v", dropIn.Name, err)
	}
}

// checkDropIn decodes the drop-in strictly into containerd's own config
// type (containerd 2.x's; 1.6 has the same fields for these keys) and
// checks that it replaces the content store with the plugin on sock.
func checkDropIn(b []byte, sock string) error {
	var c srvconfig.Config
	if err := toml.NewDecoder(bytes.NewReader(b)).DisallowUnknownFields().Decode(&c); err != nil {
		if serr, ok := errors.AsType[*toml.StrictMissingError](err); ok {
			return fmt.Errorf("unknown keys (containerd ignores them):\n%s", serr.String())
		}
		return err
	}
	if c.Version != 2 {
		return fmt.Errorf("version %d, want 2 (read by containerd 1.6 and 2.x)", c.Version)
	}
	return checkContentProxy(&c, sock)
}

// checkContentProxy: containerd's content store is the plugin on sock.
func checkContentProxy(c *srvconfig.Config, sock string) error {
	var errs []error
	if !slices.Contains(c.DisabledPlugins, "io.containerd.content.v1.content") {
		errs = append(errs, errors.New("the built-in content store io.containerd.content.v1.content is not disabled"))
	}
	n := 0
	for name, p := range c.ProxyPlugins {
		if p.Type != "content" {
			continue
		}
		n++
		if p.Address != sock {
			errs = append(errs, fmt.Errorf("proxy plugin %s: address %q, want the plugin's socket %q", name, p.Address, sock))
		}
	}
	if n != 1 {
		errs = append(errs, fmt.Errorf("%d content proxy plugins, want 1", n))
	}
	return errors.Join(errs...)
}

func TestKustomizations(t *testing.T) {
	env := helpOf(t)
	fsys := filesys.MakeFsOnDisk()
	for _, k := range kustomizations {
		t.Run(k.dir, func(t *testing.T) {
			if err := check(fsys, k.dir, k.namespace, k.kinds, env); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestEveryFileIsBuilt: a file no kustomization names would escape every
// check above.
func TestEveryFileIsBuilt(t *testing.T) {
	named := map[string]bool{}
	err := filepath.WalkDir("kubernetes", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "kustomization.yaml" {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		var k kusttypes.Kustomization
		if err := yaml.UnmarshalStrict(b, &k); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		dir := filepath.Dir(p)
		for _, r := range slices.Concat(k.Resources, k.Components) {
			named[filepath.Join(dir, r)] = true
		}
		for _, pt := range k.Patches {
			if pt.Path != "" {
				named[filepath.Join(dir, pt.Path)] = true
			}
		}
		for _, g := range k.ConfigMapGenerator {
			for _, f := range g.FileSources {
				_, src, _ := strings.Cut(f, "=")
				if src == "" {
					src = f
				}
				named[filepath.Join(dir, src)] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir("kubernetes", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			built := slices.ContainsFunc(kustomizations, func(k kustomizationCase) bool { return k.dir == p })
			if !built && !named[p] {
				t.Errorf("%s: no kustomization includes this directory", p)
			}
			return nil
		}
		if d.Name() != "kustomization.yaml" && !named[p] {
			t.Errorf("%s: no kustomization names this file", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestTypos shows that the checks above fail on a typo: each case copies
// the manifests into memory, changes one thing, and expects check to fail.
func TestTypos(t *testing.T) {
	env := helpOf(t)
	cases := []struct {
		file, old, new string
		want           string // in the error
	}{
		{"kubernetes/server/deployment.yaml", "readOnlyRootFilesystem", "readOnlyRootFileSystem", "unknown field"},
		{"kubernetes/server/deployment.yaml", "path: /readyz\n              port: http\n            periodSeconds: 5", "path: /healthz\n              port: http\n            periodSeconds: 5", "readinessProbe must be GET /readyz"},
		{"kubernetes/server/deployment.yaml", "path: /healthz\n              port: http\n            initialDelaySeconds: 5", "path: /readyz\n              port: http\n            initialDelaySeconds: 5", "livenessProbe must be GET /healthz"},
		{"kubernetes/server/deployment.yaml", "replicas: 1", "replicas: 3", "replicas must be 1"},
		{"kubernetes/server/deployment.yaml", "type: Recreate", "type: RollingUpdate", "Recreate"},
		{"kubernetes/server/deployment.yaml", "DLOCK_LISTEN", "DLOCK_LISTN", "DLOCK_LISTN"},
		{"kubernetes/server/deployment.yaml", `"--refcount=server"`, `"--refcount=off"`, "--refcount=server"},
		{"kubernetes/server/deployment.yaml", "memory: 512Mi", "memroy: 512Mi", "memory request and limit must be set"},
		{"kubernetes/server/deployment.yaml", "claimName: dlock-data", "claimName: dlock-dat", "dlock-dat"},
		{"kubernetes/server/service.yaml", "targetPort: http", "targetPort: htpp", "htpp"},
		{"kubernetes/server/pdb.yaml", "apiVersion: policy/v1", "apiVersion: policy/v1beta1", "policy/v1beta1"},
		{"kubernetes/server/networkpolicy.yaml", "- port: http", "- port: metrics", "metrics"},
		{"kubernetes/server/kustomization.yaml", "resources:", "resource:", "resource"},
		{"kubernetes/content/daemonset.yaml", "mountPath: /run/dlock-content", "mountpath: /run/dlock-content", "unknown field"},
		{"kubernetes/content/daemonset.yaml", "value: /run/dlock-content/content.sock", "value: /var/run/dlock-content/content.sock", "hostPath"},
		{"kubernetes/content/daemonset.yaml", "value: https://dlock:7380", "value: https://dlock:7381", "no Service port"},
		{"kubernetes/content/daemonset.yaml", "value: https://dlock:7380", "value: http://dlock:7380", "https"},
		{"kubernetes/content/daemonset.yaml", "value: /etc/dlock-content/token", "value: /etc/dlock/token", "not in a read-only hostPath"},
		{"kubernetes/server/deployment.yaml", "value: /etc/dlock/tokens/tokens", "value: /etc/dlock/token/tokens", "not in a Secret volume"},
		{"kubernetes/server/deployment.yaml", "            - name: tls\n              mountPath: /etc/dlock/tls\n              readOnly: true", "            - name: tls\n              mountPath: /etc/dlock/tls\n              readOnly: false", "read-write"},
		{"kubernetes/server/deployment.yaml", "            defaultMode: 0440\n        - name: tls", "            defaultMode: 0444\n        - name: tls", "defaultMode"},
		{"kubernetes/server/deployment.yaml", "            - name: DLOCK_TLS_CERT\n", "            - name: DLOCK_TLS_CRT\n", "DLOCK_TLS_CRT"},
		{"kubernetes/server/deployment.yaml", "              scheme: HTTPS\n              path: /readyz\n              port: http\n            periodSeconds: 5", "              path: /readyz\n              port: http\n            periodSeconds: 5", "over HTTPS"},
		{"kubernetes/ha/server.yaml", "  replicas: 3", "  replicas: 2", "3 replicas or more"},
		{"kubernetes/ha/server.yaml", "      maxSurge: 0", "      maxSurge: 1", "maxSurge must be 0"},
		{"kubernetes/ha/server.yaml", "            - topologyKey: kubernetes.io/hostname", "            - topologyKey: topology.kubernetes.io/zone", "anti-affinity"},
		{"kubernetes/ha/server.yaml", "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379,https://etcd-2.etcd:2379", "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379,https://etcd-3.etcd:2379", "etcd-3.etcd"},
		{"kubernetes/ha/server.yaml", "value: /etc/dlock/etcd/tls.key", "value: /etc/dlock/etcd-client/tls.key", "not in a Secret volume"},
		{"kubernetes/ha/server.yaml", "              value: etcd\n", "              value: etdc\n", "etdc"},
		{"kubernetes/ha/no-data-pvc.yaml", "name: dlock-data", "name: dlock-dat", "PersistentVolumeClaim"},
		{"kubernetes/ha/etcd-statefulset.yaml", "podManagementPolicy: Parallel", "podManagementPolicy: OrderedReady", "Parallel"},
		{"kubernetes/ha/etcd-statefulset.yaml", "- name: ETCD_PEER_CLIENT_CERT_AUTH", "- name: ETCD_PEER_CLIENT_CERT_AUTHS", "ETCD_PEER_CLIENT_CERT_AUTHS"},
		{"kubernetes/ha/etcd-statefulset.yaml", "etcd-2=https://etcd-2.etcd:2380", "etcd-2=https://etcd-2.etcd:2381", "ETCD_INITIAL_CLUSTER"},
		{"kubernetes/ha/etcd-statefulset.yaml", "value: https://$(ETCD_NAME).etcd:2380", "value: https://$(ETCD_NAME):2380", "ETCD_INITIAL_ADVERTISE_PEER_URLS"},
		{"kubernetes/ha/etcd-statefulset.yaml", "  replicas: 3", "  replicas: 2", "odd number"},
		{"kubernetes/ha/etcd-statefulset.yaml", "value: /var/lib/etcd/data", "value: /var/etcd/data", "volumeClaimTemplate"},
		{"kubernetes/ha/etcd-service.yaml", "publishNotReadyAddresses: true", "publishNotReadyAddresses: false", "headless"},
		{"kubernetes/ha/etcd-pdb.yaml", "maxUnavailable: 1", "maxUnavailable: 2", "maxUnavailable: 1"},
		{"kubernetes/ha/kustomization.yaml", "  - ../mtls", "  - ../mtsl", "mtsl"},
		{"kubernetes/mtls/server.yaml", "DLOCK_CLIENT_CA", "DLOCK_CLIENT_CAS", "DLOCK_CLIENT_CAS"},
		{"kubernetes/content/daemonset.yaml", "fieldPath: spec.nodeName", "fieldPath: metadata.name", "spec.nodeName"},
		{"kubernetes/content/containerd-dlock.toml", "address =", "adress =", "adress"},
		{"kubernetes/content/containerd-dlock.toml", `address = "/run/dlock-content/content.sock"`, `address = "/run/dlock-content/containerd.sock"`, "want the plugin's socket"},
		{"kubernetes/content/containerd-dlock.toml", `"io.containerd.content.v1.content"`, `"io.containerd.content.v1"`, "not disabled"},
		{"kubernetes/content/pvc.yaml", `accessModes: ["ReadWriteMany"]`, `accessModes: ["ReadWriteOnce"]`, "must be ReadWriteMany"},
		{"kubernetes/kustomization.yaml", "newName: registry.example.com/dlock", "newNam: registry.example.com/dlock", "newNam"},
		{"kubernetes/namespace/namespace.yaml", "kind: Namespace", "kind: Namespaces", "Namespaces"},
	}
	for _, tc := range cases {
		name, _, _ := strings.Cut(tc.new, "\n")
		t.Run(tc.file+":"+name, func(t *testing.T) {
			fsys := copyTree(t, "kubernetes", tc.file, tc.old, tc.new)
			var errs []error
			// Every layout: a file may be in several (server/ is in all
			// but content/, mtls/ only in ha/).
			for _, k := range kustomizations {
				errs = append(errs, check(fsys, k.dir, k.namespace, k.kinds, env))
			}
			err := errors.Join(errs...)
			if err == nil {
				t.Fatalf("%s: %q → %q: every check passed", tc.file, tc.old, tc.new)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%s: %q → %q: the error does not say %q:\n%v", tc.file, tc.old, tc.new, tc.want, err)
			}
			t.Log(err)
		})
	}
}

// copyTree copies dir into an in-memory file system, replacing old with
// new, exactly once, in file.
func copyTree(t *testing.T, dir, file, old, new string) filesys.FileSystem {
	t.Helper()
	fsys := filesys.MakeFsInMemory()
	replaced := false
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if p == file {
			if n := bytes.Count(b, []byte(old)); n != 1 {
				t.Fatalf("%s: %q occurs %d times; the case must change exactly one place", file, old, n)
			}
			b = bytes.Replace(b, []byte(old), []byte(new), 1)
			replaced = true
		}
		return fsys.WriteFile(p, b)
	})
	if err != nil {
		t.Fatal(err)
	}
	if !replaced {
		t.Fatalf("%s: no such file", file)
	}
	return fsys
}
