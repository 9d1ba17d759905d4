package content

import (
	"io/fs"
	"syscall"
	"time"
)

// atime is a blob's access time, where containerd's local store keeps the
// time of its last label update.
func atime(fi fs.FileInfo) time.Time {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return time.Unix(st.Atim.Unix())
	}
	return fi.ModTime()
}
