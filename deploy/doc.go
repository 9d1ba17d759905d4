// Package deploy holds no code: its tests check the deployment files beside
// it (kubernetes/, systemd/) without a cluster or a running systemd, and fail
// on a typo in any of them, and build and run the image that
// cmd/dlock-image makes. It is a module of its own so that the Kubernetes
// and image libraries stay out of dlock's module.
package deploy
