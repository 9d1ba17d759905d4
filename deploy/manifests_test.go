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
// (kubernetes/) and its two parts (a cluster that runs dlock-content from
// systemd on the hosts builds only server/).
var kustomizations = []struct {
	dir       string
	namespace string   // every namespaced object's, "" for none
	kinds     []string // exactly the kinds of the output
}{
	{"kubernetes", "dlock", []string{"ConfigMap", "DaemonSet", "Deployment", "Namespace", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"}},
	{"kubernetes/server", "", []string{"Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"}},
	{"kubernetes/content", "", []string{"ConfigMap", "DaemonSet", "NetworkPolicy", "PersistentVolumeClaim"}},
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
	type pod struct {
		owner string
		spec  *corev1.PodSpec
		meta  map[string]string // labels
	}
	var pods []pod
	for _, d := range of[*appsv1.Deployment](objs) {
		pods = append(pods, pod{"Deployment " + d.Name, &d.Spec.Template.Spec, d.Spec.Template.Labels})
		checkSelector(fail, "Deployment "+d.Name, d.Spec.Selector, d.Spec.Template.Labels)
	}
	for _, d := range of[*appsv1.DaemonSet](objs) {
		pods = append(pods, pod{"DaemonSet " + d.Name, &d.Spec.Template.Spec, d.Spec.Template.Labels})
		checkSelector(fail, "DaemonSet "+d.Name, d.Spec.Selector, d.Spec.Template.Labels)
	}
	for _, p := range pods {
		checkPod(fail, p.owner, p.spec, pvcs, namespace != "")
	}

	services := of[*corev1.Service](objs)
	for _, d := range of[*appsv1.Deployment](objs) {
		checkServer(fail, d, pvcs, env)
	}
	for _, d := range of[*appsv1.DaemonSet](objs) {
		checkContent(fail, d, pvcs, services, of[*corev1.ConfigMap](objs), env)
	}

	// Every selector must select a pod of this output, and every port it
	// names must be one of that pod's.
	podsOf := func(sel labels.Selector) []pod {
		var out []pod
		for _, p := range pods {
			if sel.Matches(labels.Set(p.meta)) {
				out = append(out, p)
			}
		}
		return out
	}
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

func checkSelector(fail func(string, ...any), owner string, sel *metav1LabelSelector, podLabels map[string]string) {
	s, err := metav1Selector(sel)
	if err != nil || sel == nil || len(sel.MatchLabels) == 0 || !s.Matches(labels.Set(podLabels)) {
		fail("%s: selector does not select its own pod template (%v)", owner, err)
	}
}

// checkPod: what every pod of dlock must have, whatever it runs.
func checkPod(fail func(string, ...any), owner string, spec *corev1.PodSpec, pvcs map[string]*corev1.PersistentVolumeClaim, imagesSet bool) {
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
			if _, ok := volumes[m.Name]; !ok {
				fail("%s: volumeMount %s names no volume", where, m.Name)
			}
		}
	}
}

// checkServer: the dlock server's Deployment.
func checkServer(fail func(string, ...any), d *appsv1.Deployment, pvcs map[string]*corev1.PersistentVolumeClaim, env knownEnv) {
	where := "Deployment " + d.Name
	// The memory backend keeps all lock state in one process: two replicas
	// would be two lock services, and an update must not overlap them.
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 {
		fail("%s: replicas must be 1 on the memory backend", where)
	}
	if d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		fail("%s: strategy must be Recreate (never two servers at once)", where)
	}
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
	if b := flags["backend"]; b != "" && b != "memory" {
		fail("%s: backend %q: this layout is for the memory backend", where, b)
	}
	host, port, err := net.SplitHostPort(flags["listen"])
	if err != nil || (host != "0.0.0.0" && host != "" && host != "::") {
		fail("%s: --listen %q: the Service cannot reach anything but 0.0.0.0:PORT (%v)", where, flags["listen"], err)
	}
	apiPort := containerPort(c, port)
	if apiPort == nil {
		fail("%s: the listen port %q is not a containerPort", where, port)
	} else {
		for name, p := range map[string]*corev1.Probe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe} {
			if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" || !portIs(p.HTTPGet.Port, apiPort) {
				fail("%s: %s must be GET /healthz on port %d", where, name, apiPort.ContainerPort)
			}
		}
		a := d.Spec.Template.Annotations
		if a["prometheus.io/scrape"] != "true" || a["prometheus.io/path"] != "/metrics" || a["prometheus.io/port"] != strconv.Itoa(int(apiPort.ContainerPort)) {
			fail("%s: Prometheus annotations must scrape /metrics on port %d, got %v", where, apiPort.ContainerPort, a)
		}
	}
	// refcount.db must outlive the pod.
	if v := volumeAt(spec, c, flags["data-dir"]); v == nil || v.PersistentVolumeClaim == nil {
		fail("%s: --data-dir %q is not on a PersistentVolumeClaim", where, flags["data-dir"])
	} else if p := pvcs[v.PersistentVolumeClaim.ClaimName]; p != nil && !slices.Contains(p.Spec.AccessModes, corev1.ReadWriteOnce) {
		fail("%s: the data PersistentVolumeClaim should be ReadWriteOnce", where)
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
		for _, r := range k.Resources {
			named[filepath.Join(dir, r)] = true
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
			if p != "kubernetes" && !named[p] {
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
		{"kubernetes/server/deployment.yaml", "path: /healthz\n              port: http\n            periodSeconds: 5", "path: /health\n              port: http\n            periodSeconds: 5", "readinessProbe must be GET /healthz"},
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
		{"kubernetes/content/daemonset.yaml", "value: http://dlock:7380", "value: http://dlock:7381", "no Service port"},
		{"kubernetes/content/daemonset.yaml", "fieldPath: spec.nodeName", "fieldPath: metadata.name", "spec.nodeName"},
		{"kubernetes/content/containerd-dlock.toml", "address =", "adress =", "adress"},
		{"kubernetes/content/containerd-dlock.toml", `address = "/run/dlock-content/content.sock"`, `address = "/run/dlock-content/containerd.sock"`, "want the plugin's socket"},
		{"kubernetes/content/containerd-dlock.toml", `"io.containerd.content.v1.content"`, `"io.containerd.content.v1"`, "not disabled"},
		{"kubernetes/content/pvc.yaml", `accessModes: ["ReadWriteMany"]`, `accessModes: ["ReadWriteOnce"]`, "must be ReadWriteMany"},
		{"kubernetes/kustomization.yaml", "newName: registry.example.com/dlock", "newNam: registry.example.com/dlock", "newNam"},
		{"kubernetes/namespace.yaml", "kind: Namespace", "kind: Namespaces", "Namespaces"},
	}
	for _, tc := range cases {
		name, _, _ := strings.Cut(tc.new, "\n")
		t.Run(tc.file+":"+name, func(t *testing.T) {
			fsys := copyTree(t, "kubernetes", tc.file, tc.old, tc.new)
			var errs []error
			for _, k := range kustomizations {
				if strings.HasPrefix(tc.file, k.dir+"/") {
					errs = append(errs, check(fsys, k.dir, k.namespace, k.kinds, env))
				}
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
