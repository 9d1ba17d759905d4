package etcd

// Before35ForTest is before35: whether an etcd version predates 3.5.
var Before35ForTest = before35

// VersionsCheckedForTest is closed once b has checked etcd's versions.
func VersionsCheckedForTest(b *Backend) <-chan struct{} { return b.versionsChecked }
