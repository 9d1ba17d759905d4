//go:build !linux

package content

import (
	"io/fs"
	"time"
)

// atime falls back to the modification time where the access time is not
// read (dlock-content runs on Linux).
func atime(fi fs.FileInfo) time.Time { return fi.ModTime() }
