package deploy

// The part of systemd that these tests need, run in place of systemctl,
// journalctl and ssh inside a test host (hosts_test.go): this machine has
// no systemd as PID 1, so deploy/README.md's `systemctl enable --now …`
// starts a unit the way systemd would, from the installed unit file and its
// drop-ins, for the settings the units here and Debian's etcd and containerd
// units use:
//
//   - the environment: Environment= (with specifiers), EnvironmentFile=
//     (which wins over it), and what systemd adds: STATE_DIRECTORY,
//     RUNTIME_DIRECTORY, CREDENTIALS_DIRECTORY, NOTIFY_SOCKET, USER, HOME;
//   - the user: DynamicUser= (a uid that no account has, as systemd picks
//     one), or User= and Group= looked up in the host's /etc/passwd;
//   - StateDirectory= and RuntimeDirectory= with their modes, made and given
//     to that user;
//   - LoadCredential=: each file read as root and copied into
//     /run/credentials/UNIT, mode 0400 and the directory 0500, owned by the
//     unit's user, as systemd does; a missing file fails the start;
//   - ExecStartPre= and ExecStart= split and expanded as systemd does
//     (quotes, specifiers %d %H %n %N %p %t %S %%, ${VAR} and $VAR), run as
//     the unit's user in a session of their own, with UMask= and
//     LimitNOFILE=, output to the unit's log (journalctl -u);
//   - Type=notify waits for READY=1 (unless --no-block), Type=exec and
//     simple for the exec;
//   - stop: KillSignal= (SIGTERM) to the process group, SIGKILL after
//     TimeoutStopSec= (90 s); the credentials are removed.
//
// Not emulated: the sandboxing settings (ProtectSystem=, SystemCallFilter=,
// PrivateTmp=, …; `systemd-analyze verify` checks them), Restart=, and
// ordering (After=, Before=): the README's commands start the units in an
// order that works without it.

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Inside a test host: each unit's pid file, log and notify socket.
const unitStateDir = "/run/dlock-deploy-units"

var unitDirs = []string{"/etc/systemd/system", "/run/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system"}

// emulated runs the emulation named by the name it was called by, and says
// whether it did (TestMain).
func emulated(args []string) (code int, ok bool) {
	name := filepath.Base(args[0])
	var err error
	switch name {
	case "systemctl":
		err = systemctlMain(args[1:])
	case "journalctl":
		err = journalctlMain(args[1:], os.Stdout)
	case "ssh":
		err = sshMain(args[1:])
	default:
		return 0, false
	}
	var ex *exitError
	switch {
	case errors.As(err, &ex):
		return ex.code, true
	case err != nil:
		fmt.Fprintf(os.Stderr, "%s (test emulation): %v\n", name, err)
		return 1, true
	}
	return 0, true
}

type exitError struct{ code int }

func (e *exitError) Error() string { return "exit status " + strconv.Itoa(e.code) }

func unitName(s string) string {
	if !strings.Contains(s, ".") {
		return s + ".service"
	}
	return s
}

func systemctlMain(args []string) error {
	var verb string
	var units []string
	now, block := false, true
	for _, a := range args {
		switch {
		case a == "--now":
			now = true
		case a == "--no-block":
			block = false
		case a == "-q" || a == "--quiet" || a == "--no-pager":
		case strings.HasPrefix(a, "-"):
			return fmt.Errorf("option %s is not emulated", a)
		case verb == "":
			verb = a
		default:
			units = append(units, unitName(a))
		}
	}
	switch verb {
	case "daemon-reload":
		return nil
	case "enable", "disable":
		// Boot is not emulated: only --now acts.
		for _, u := range units {
			if _, err := loadUnit(u); err != nil {
				return err
			}
		}
		if !now {
			return nil
		}
		if verb == "disable" {
			return each(units, stopUnit)
		}
		return each(units, func(u string) error { return startUnit(u, block) })
	case "start":
		return each(units, func(u string) error { return startUnit(u, block) })
	case "stop":
		return each(units, stopUnit)
	case "restart":
		return each(units, func(u string) error {
			if err := stopUnit(u); err != nil {
				return err
			}
			return startUnit(u, block)
		})
	case "is-active":
		code := 0
		for _, u := range units {
			if _, ok := running(u); ok {
				fmt.Println("active")
			} else {
				fmt.Println("inactive")
				code = 3
			}
		}
		if code != 0 {
			return &exitError{code}
		}
		return nil
	}
	return fmt.Errorf("systemctl %s is not emulated", verb)
}

func each(units []string, f func(string) error) error {
	if len(units) == 0 {
		return errors.New("no unit named")
	}
	for _, u := range units {
		if err := f(u); err != nil {
			return fmt.Errorf("%s: %w", u, err)
		}
	}
	return nil
}

// loadUnit reads a unit and its drop-ins as systemd does: the first file
// of that name along the unit path, then every NAME.d/*.conf in the order
// of their file names (one in /etc hides one of the same name further on).
func loadUnit(name string) (unit, error) {
	u := unit{}
	found := false
	for _, d := range unitDirs {
		b, err := os.ReadFile(filepath.Join(d, name))
		if err == nil {
			parseUnitInto(u, string(b))
			found = true
			break
		}
	}
	if !found {
		return nil, fmt.Errorf("unit %s not found", name)
	}
	dropIns := map[string]string{}
	for i := len(unitDirs) - 1; i >= 0; i-- {
		ms, _ := filepath.Glob(filepath.Join(unitDirs[i], name+".d", "*.conf"))
		for _, m := range ms {
			dropIns[filepath.Base(m)] = m
		}
	}
	names := make([]string, 0, len(dropIns))
	for n := range dropIns {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		b, err := os.ReadFile(dropIns[n])
		if err != nil {
			return nil, err
		}
		parseUnitInto(u, string(b))
	}
	return u, nil
}

// specifiers expands systemd's %-specifiers that the units use; any other
// is an error, as it is to systemd.
func specifiers(s, name string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i++; i == len(s) {
			return "", fmt.Errorf("%q: a %% at the end", s)
		}
		prefix, _, _ := strings.Cut(strings.TrimSuffix(name, path.Ext(name)), "@")
		switch s[i] {
		case '%':
			b.WriteByte('%')
		case 'd':
			b.WriteString(credentialsDir(name))
		case 'H':
			h, err := os.Hostname()
			if err != nil {
				return "", err
			}
			b.WriteString(h)
		case 'n':
			b.WriteString(name)
		case 'N':
			b.WriteString(strings.TrimSuffix(name, path.Ext(name)))
		case 'p':
			b.WriteString(prefix)
		case 't':
			b.WriteString("/run")
		case 'S':
			b.WriteString("/var/lib")
		default:
			return "", fmt.Errorf("%q: specifier %%%c is not emulated", s, s[i])
		}
	}
	return b.String(), nil
}

func credentialsDir(name string) string { return "/run/credentials/" + name }

// splitWords splits a setting into words as systemd does: whitespace
// separates, single and double quotes group, a backslash escapes.
func splitWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	in, quote := false, byte(0)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0 && c == quote:
			quote = 0
		case quote == 0 && (c == '"' || c == '\''):
			quote, in = c, true
		case c == '\\' && quote != '\'':
			if i++; i == len(s) {
				return nil, fmt.Errorf("%q: a backslash at the end", s)
			}
			switch s[i] {
			case 'n':
				w.WriteByte('\n')
			case 't':
				w.WriteByte('\t')
			default:
				w.WriteByte(s[i])
			}
			in = true
		case quote == 0 && (c == ' ' || c == '\t'):
			if in {
				words = append(words, w.String())
				w.Reset()
				in = false
			}
		default:
			w.WriteByte(c)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("%q: a quote is not closed", s)
	}
	if in {
		words = append(words, w.String())
	}
	return words, nil
}

// commandLine turns an Exec*= value into argv: words, then $VAR (a word of
// its own: split into words) and ${VAR} (anywhere: one word) from env.
// The flags are the executable's prefixes: '-' (a failure is ignored) and
// '+' (run as root); others are not emulated.
func commandLine(value, name string, env map[string]string) (argv []string, ignoreFailure, asRoot bool, err error) {
	value, err = specifiers(value, name)
	if err != nil {
		return nil, false, false, err
	}
	words, err := splitWords(value)
	if err != nil || len(words) == 0 {
		return nil, false, false, fmt.Errorf("command line %q: %v", value, err)
	}
	for len(words[0]) > 0 && strings.ContainsRune("-+@:!", rune(words[0][0])) {
		switch words[0][0] {
		case '-':
			ignoreFailure = true
		case '+':
			asRoot = true
		default:
			return nil, false, false, fmt.Errorf("command line %q: prefix %c is not emulated", value, words[0][0])
		}
		words[0] = words[0][1:]
	}
	for _, w := range words {
		if len(w) > 1 && w[0] == '$' && w[1] != '{' && isName(w[1:]) {
			argv = append(argv, strings.Fields(env[w[1:]])...)
			continue
		}
		argv = append(argv, expandBraced(w, env))
	}
	if !filepath.IsAbs(argv[0]) {
		return nil, false, false, fmt.Errorf("command line %q: the executable must be an absolute path here", value)
	}
	return argv, ignoreFailure, asRoot, nil
}

func isName(s string) bool {
	for i, c := range s {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return s != ""
}

func expandBraced(w string, env map[string]string) string {
	var b strings.Builder
	for {
		i := strings.Index(w, "${")
		if i < 0 {
			b.WriteString(w)
			return b.String()
		}
		j := strings.IndexByte(w[i:], '}')
		if j < 0 {
			b.WriteString(w)
			return b.String()
		}
		b.WriteString(w[:i])
		b.WriteString(env[w[i+2:i+j]])
		w = w[i+j+1:]
	}
}

// readEnvFile reads an EnvironmentFile= as systemd does for the files
// here: KEY=VALUE lines, comments (# ;) and blank lines ignored, a value in
// quotes unquoted.
func readEnvFile(p string, env map[string]string) error {
	b, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		env[k] = v
	}
	return nil
}

// dynamicUID is the uid a DynamicUser= unit runs as: in systemd's range
// for them, from the unit's name, and no account's.
func dynamicUID(name string) int {
	h := fnv.New32a()
	h.Write([]byte(name))
	uid := 61184 + int(h.Sum32()%(65519-61184+1))
	for {
		if _, err := user.LookupId(strconv.Itoa(uid)); err != nil {
			return uid
		}
		uid++
	}
}

type unitUser struct {
	uid, gid int
	name     string
	home     string
}

func (u unit) user(name string) (*unitUser, error) {
	s := u.get("Service", "User")
	if u.get("Service", "DynamicUser") == "yes" {
		id := dynamicUID(name)
		if s == "" {
			s = strings.TrimSuffix(name, path.Ext(name))
		}
		return &unitUser{uid: id, gid: id, name: s, home: "/"}, nil
	}
	if s == "" || s == "root" {
		return nil, nil
	}
	pw, err := user.Lookup(s)
	if err != nil {
		return nil, fmt.Errorf("User=%s: %w", s, err)
	}
	uu := &unitUser{name: s, home: pw.HomeDir}
	uu.uid, _ = strconv.Atoi(pw.Uid)
	uu.gid, _ = strconv.Atoi(pw.Gid)
	if g := u.get("Service", "Group"); g != "" {
		gr, err := user.LookupGroup(g)
		if err != nil {
			return nil, fmt.Errorf("Group=%s: %w", g, err)
		}
		uu.gid, _ = strconv.Atoi(gr.Gid)
	}
	return uu, nil
}

func (uu *unitUser) credential() *syscall.Credential {
	if uu == nil {
		return nil
	}
	return &syscall.Credential{Uid: uint32(uu.uid), Gid: uint32(uu.gid), Groups: []uint32{}}
}

func (uu *unitUser) chown(p string) error {
	if uu == nil {
		return nil
	}
	return os.Chown(p, uu.uid, uu.gid)
}

func modeOf(s string, def fs.FileMode) (fs.FileMode, error) {
	if s == "" {
		return def, nil
	}
	m, err := strconv.ParseUint(s, 8, 32)
	return fs.FileMode(m), err
}

// directories makes StateDirectory= (under /var/lib) or RuntimeDirectory=
// (under /run) for the unit's user and returns their paths.
func (u unit) directories(key, base string, def fs.FileMode, uu *unitUser) ([]string, error) {
	mode, err := modeOf(u.get("Service", key+"Mode"), def)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, d := range u.all("Service", key) {
		p := filepath.Join(base, d)
		if err := os.MkdirAll(p, mode); err != nil {
			return nil, err
		}
		if err := os.Chmod(p, mode); err != nil {
			return nil, err
		}
		// systemd gives an existing directory to the unit's user with
		// everything in it (a dynamic user's uid may differ from the last
		// start's).
		err := filepath.WalkDir(p, func(q string, _ fs.DirEntry, err error) error {
			if err != nil || uu == nil {
				return err
			}
			return os.Lchown(q, uu.uid, uu.gid)
		})
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// loadCredentials copies each LoadCredential=ID:PATH into the unit's
// credentials directory as systemd does: read as root, written mode 0400
// in a directory of mode 0500, both owned by the unit's user.
func (u unit) loadCredentials(name string, uu *unitUser) (string, error) {
	creds := u.all("Service", "LoadCredential")
	dir := credentialsDir(name)
	if err := os.RemoveAll(dir); err != nil {
		return "", err
	}
	if len(creds) == 0 {
		return "", nil
	}
	// /run/credentials is every unit's way in; each unit's directory is
	// its user's alone.
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", err
	}
	for _, c := range creds {
		id, src, ok := strings.Cut(c, ":")
		if !ok || !filepath.IsAbs(src) || strings.Contains(id, "/") {
			return "", fmt.Errorf("LoadCredential=%s: only ID:/ABSOLUTE/PATH is emulated", c)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			return "", fmt.Errorf("LoadCredential=%s: %w (systemd fails the start: status=243/CREDENTIALS)", c, err)
		}
		p := filepath.Join(dir, id)
		if err := os.WriteFile(p, b, 0o400); err != nil {
			return "", err
		}
		if err := uu.chown(p); err != nil {
			return "", err
		}
	}
	if err := os.Chmod(dir, 0o500); err != nil {
		return "", err
	}
	return dir, uu.chown(dir)
}

func (u unit) environment(name string, uu *unitUser) (map[string]string, error) {
	env := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	id := make([]byte, 16)
	rand.Read(id)
	env["INVOCATION_ID"] = hex.EncodeToString(id)
	if uu != nil {
		env["USER"], env["LOGNAME"], env["HOME"], env["SHELL"] = uu.name, uu.name, uu.home, "/usr/sbin/nologin"
	}
	for _, line := range u["Service"]["Environment"] {
		line, err := specifiers(line, name)
		if err != nil {
			return nil, err
		}
		words, err := splitWords(line)
		if err != nil {
			return nil, fmt.Errorf("Environment=%s: %w", line, err)
		}
		for _, w := range words {
			k, v, ok := strings.Cut(w, "=")
			if !ok || !isName(k) {
				return nil, fmt.Errorf("Environment=%s: %q is no assignment", line, w)
			}
			env[k] = v
		}
	}
	for _, f := range u["Service"]["EnvironmentFile"] {
		f, err := specifiers(f, name)
		if err != nil {
			return nil, err
		}
		optional := strings.HasPrefix(f, "-")
		if err := readEnvFile(strings.TrimPrefix(f, "-"), env); err != nil && !(optional && errors.Is(err, fs.ErrNotExist)) {
			return nil, fmt.Errorf("EnvironmentFile=%s: %w", f, err)
		}
	}
	return env, nil
}

func envList(env map[string]string) []string {
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

func pidFile(name string) string { return filepath.Join(unitStateDir, name+".pid") }
func logFile(name string) string { return filepath.Join(unitStateDir, name+".log") }

// running is the unit's main process, if it still runs (and is not a
// zombie its reaper has yet to collect).
func running(name string) (int, bool) {
	b, err := os.ReadFile(pidFile(name))
	if err != nil {
		return 0, false
	}
	pid, start, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	n, err := strconv.Atoi(pid)
	if err != nil {
		return 0, false
	}
	st, ok := procStat(n)
	return n, ok && st.state != "Z" && st.start == start
}

type stat struct{ state, start string }

// procStat reads a process's state and start time (fields 3 and 22 of
// /proc/PID/stat), which tell a process from a later one with its pid.
func procStat(pid int) (stat, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return stat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return stat{}, false
	}
	return stat{state: f[0], start: f[19]}, true
}

func startUnit(name string, block bool) error {
	if _, ok := running(name); ok {
		return nil
	}
	u, err := loadUnit(name)
	if err != nil {
		return err
	}
	typ := u.get("Service", "Type")
	if typ == "" {
		typ = "simple"
	}
	if !slices.Contains([]string{"simple", "exec", "notify"}, typ) {
		return fmt.Errorf("Type=%s is not emulated", typ)
	}
	uu, err := u.user(name)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(unitStateDir, 0o755); err != nil {
		return err
	}
	env, err := u.environment(name, uu)
	if err != nil {
		return err
	}
	// systemd's own variables come first; the unit's settings win.
	own := map[string]string{}
	for _, d := range []struct {
		key, base, env string
		mode           fs.FileMode
	}{{"StateDirectory", "/var/lib", "STATE_DIRECTORY", 0o755}, {"RuntimeDirectory", "/run", "RUNTIME_DIRECTORY", 0o755}} {
		ps, err := u.directories(d.key, d.base, d.mode, uu)
		if err != nil {
			return err
		}
		if len(ps) > 0 {
			own[d.env] = strings.Join(ps, ":")
		}
	}
	creds, err := u.loadCredentials(name, uu)
	if err != nil {
		return err
	}
	if creds != "" {
		own["CREDENTIALS_DIRECTORY"] = creds
	}
	var notify *notifySocket
	if typ == "notify" && block {
		if notify, err = listenNotify(name); err != nil {
			return err
		}
		defer notify.close()
		own["NOTIFY_SOCKET"] = notify.path
	}
	for k, v := range env {
		own[k] = v
	}
	env = own

	umask, err := modeOf(u.get("Service", "UMask"), 0o022)
	if err != nil {
		return err
	}
	syscall.Umask(int(umask))
	var limit *syscall.Rlimit
	if n := u.get("Service", "LimitNOFILE"); n != "" {
		v, err := strconv.ParseUint(n, 10, 64)
		if n == "infinity" {
			// The kernel's ceiling for it.
			b, rerr := os.ReadFile("/proc/sys/fs/nr_open")
			v, err = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
			err = errors.Join(rerr, err)
		}
		if err != nil {
			return fmt.Errorf("LimitNOFILE=%s: %w", n, err)
		}
		limit = &syscall.Rlimit{Cur: v, Max: v}
	}
	log, err := os.OpenFile(logFile(name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer log.Close()
	fmt.Fprintf(log, "-- %s: started by the test's systemctl emulation as %s\n", name, describe(uu))
	if limit != nil {
		err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, limit)
		if errors.Is(err, syscall.EPERM) {
			// Without CAP_SYS_RESOURCE (a container) the hard limit
			// cannot rise: the unit gets what there is.
			var cur syscall.Rlimit
			if err = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &cur); err == nil {
				fmt.Fprintf(log, "-- LimitNOFILE=%d: this machine allows at most %d\n", limit.Max, cur.Max)
				err = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: cur.Max, Max: cur.Max})
			}
		}
		if err != nil {
			return fmt.Errorf("LimitNOFILE=%d: %w", limit.Max, err)
		}
	}

	permissionsStartOnly := u.get("Service", "PermissionsStartOnly") == "yes"
	for _, pre := range u["Service"]["ExecStartPre"] {
		argv, ignore, asRoot, err := commandLine(pre, name, env)
		if err != nil {
			return err
		}
		cmd := unitCommand(argv, env, log, uu)
		if asRoot || permissionsStartOnly {
			cmd.SysProcAttr.Credential = nil
		}
		if err := cmd.Run(); err != nil && !ignore {
			return fmt.Errorf("ExecStartPre=%s: %w", pre, err)
		}
	}
	starts := u["Service"]["ExecStart"]
	if len(starts) != 1 {
		return fmt.Errorf("%d ExecStart= lines, want 1", len(starts))
	}
	argv, _, asRoot, err := commandLine(starts[0], name, env)
	if err != nil {
		return err
	}
	cmd := unitCommand(argv, env, log, uu)
	if asRoot {
		cmd.SysProcAttr.Credential = nil
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("ExecStart: %w", err)
	}
	st, _ := procStat(cmd.Process.Pid)
	if err := os.WriteFile(pidFile(name), fmt.Appendf(nil, "%d %s\n", cmd.Process.Pid, st.start), 0o644); err != nil {
		return err
	}
	if notify == nil {
		return nil
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	return notify.waitReady(exited, 90*time.Second)
}

func describe(uu *unitUser) string {
	if uu == nil {
		return "root"
	}
	return fmt.Sprintf("%s (uid %d, gid %d)", uu.name, uu.uid, uu.gid)
}

func unitCommand(argv []string, env map[string]string, log *os.File, uu *unitUser) *exec.Cmd {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = envList(env)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: uu.credential()}
	return cmd
}

type notifySocket struct {
	path string
	conn *os.File
}

func listenNotify(name string) (*notifySocket, error) {
	p := filepath.Join(unitStateDir, name+".notify")
	os.Remove(p)
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: p}); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	// The unit's user sends to it.
	if err := os.Chmod(p, 0o666); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	return &notifySocket{path: p, conn: os.NewFile(uintptr(fd), p)}, nil
}

func (n *notifySocket) close() {
	n.conn.Close()
	os.Remove(n.path)
}

// waitReady waits for READY=1, as systemctl start does for Type=notify.
func (n *notifySocket) waitReady(exited <-chan error, timeout time.Duration) error {
	ready := make(chan error, 1)
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := n.conn.Read(buf)
			if err != nil {
				ready <- err
				return
			}
			for l := range strings.Lines(string(buf[:k])) {
				if strings.TrimSpace(l) == "READY=1" {
					ready <- nil
					return
				}
			}
		}
	}()
	select {
	case err := <-ready:
		return err
	case err := <-exited:
		return fmt.Errorf("the main process exited before READY=1: %v", err)
	case <-time.After(timeout):
		return fmt.Errorf("no READY=1 within %v", timeout)
	}
}

func stopUnit(name string) error {
	u, err := loadUnit(name)
	if err != nil {
		return err
	}
	if pid, ok := running(name); ok {
		sig := syscall.SIGTERM
		if s := u.get("Service", "KillSignal"); s != "" && s != "SIGTERM" {
			return fmt.Errorf("KillSignal=%s is not emulated", s)
		}
		timeout := 90 * time.Second
		if s := u.get("Service", "TimeoutStopSec"); s != "" {
			if timeout, err = time.ParseDuration(s); err != nil {
				return fmt.Errorf("TimeoutStopSec=%s: %w", s, err)
			}
		}
		// KillMode=control-group: the session the unit started in.
		syscall.Kill(-pid, sig)
		deadline := time.Now().Add(timeout)
		for {
			if _, ok := running(name); !ok {
				break
			}
			if time.Now().After(deadline) {
				syscall.Kill(-pid, syscall.SIGKILL)
				deadline = time.Now().Add(time.Minute)
			}
			time.Sleep(20 * time.Millisecond) // polls the state it waits for
		}
	}
	os.Remove(pidFile(name))
	if err := os.RemoveAll(credentialsDir(name)); err != nil {
		return err
	}
	for _, d := range u.all("Service", "RuntimeDirectory") {
		if u.get("Service", "RuntimeDirectoryPreserve") != "yes" {
			os.RemoveAll(filepath.Join("/run", d))
		}
	}
	return nil
}

func journalctlMain(args []string, out io.Writer) error {
	var name string
	tail := -1
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "-u" && i+1 < len(args):
			i++
			name = unitName(args[i])
		case strings.HasPrefix(a, "--unit="):
			name = unitName(strings.TrimPrefix(a, "--unit="))
		case a == "-n" && i+1 < len(args):
			i++
			n, err := strconv.Atoi(args[i])
			if err != nil {
				return err
			}
			tail = n
		case a == "--no-pager" || a == "-b" || a == "-q":
		default:
			return fmt.Errorf("journalctl %s is not emulated", a)
		}
	}
	if name == "" {
		return errors.New("journalctl: only -u UNIT is emulated")
	}
	b, err := os.ReadFile(logFile(name))
	if errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintln(out, "-- No entries --")
		return nil
	}
	if err != nil {
		return err
	}
	lines := strings.SplitAfter(string(b), "\n")
	if tail >= 0 && tail < len(lines) {
		lines = lines[len(lines)-tail-1:]
	}
	_, err = io.WriteString(out, strings.Join(lines, ""))
	return err
}

// sshMain runs `ssh HOST COMMAND…` on another test host: the command, its
// words joined by spaces as ssh does, by a shell in that host's file
// system and host name, from root's home, with this process's standard
// input and output. It stays in this host's PID namespace (a sibling's
// cannot be entered), which the commands it runs here do not notice.
func sshMain(args []string) error {
	if len(args) < 2 || strings.HasPrefix(args[0], "-") {
		return errors.New("only `ssh HOST COMMAND…` is emulated")
	}
	b, err := os.ReadFile(filepath.Join(os.Getenv("DLOCK_DEPLOY_HOSTS"), args[0]+".pid"))
	if err != nil {
		return fmt.Errorf("ssh: %s: no such test host", args[0])
	}
	ns := filepath.Join(os.Getenv(hostProcEnv), strings.TrimSpace(string(b)), "ns")
	cmd := exec.Command("nsenter", "--mount="+ns+"/mnt", "--uts="+ns+"/uts", "--",
		"/bin/sh", "-c", "cd && "+strings.Join(args[1:], " "))
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		if ee, ok := errors.AsType[*exec.ExitError](err); ok {
			return &exitError{ee.ExitCode()}
		}
		return err
	}
	return nil
}
