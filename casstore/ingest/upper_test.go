package ingest

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
)

// mountOverlay mounts an overlay at merged and unmounts it at cleanup. With upper ""
// the mount is read-only and made of lower layers only (first = top).
func mountOverlay(t testing.TB, merged string, lowers []string, upper, work, extra string) error {
	t.Helper()
	opts := "lowerdir=" + strings.Join(lowers, ":")
	var flags uintptr
	if upper != "" {
		opts += ",upperdir=" + upper + ",workdir=" + work
	} else {
		flags = unix.MS_RDONLY
	}
	if extra != "" {
		opts += "," + extra
	}
	if err := unix.Mount("overlay", merged, "overlay", flags, opts); err != nil {
		return &os.PathError{Op: "mount overlay " + opts, Path: merged, Err: err}
	}
	t.Cleanup(func() {
		if err := unix.Unmount(merged, 0); err != nil {
			t.Errorf("unmount %s: %v", merged, err)
			_ = unix.Unmount(merged, unix.MNT_DETACH)
		}
	})
	return nil
}

func whiteout(t testing.TB, path string) {
	t.Helper()
	mkdirs(t, filepath.Dir(path))
	if err := unix.Mknod(path, unix.S_IFCHR|0o000, 0); err != nil {
		t.Fatal(err)
	}
}

func setXattr(t testing.TB, path, name, value string) {
	t.Helper()
	if err := unix.Lsetxattr(path, name, []byte(value), 0); err != nil {
		t.Fatalf("setxattr %s %s: %v", path, name, err)
	}
}

func rm(t testing.TB, path string) {
	t.Helper()
	if err := os.RemoveAll(path); err != nil {
		t.Fatal(err)
	}
}

// baseLayout is the source tree most Upper cases start from.
func baseLayout(t testing.TB, d string) {
	writeFile(t, filepath.Join(d, "README"), "readme\n", 0o644)
	writeFile(t, filepath.Join(d, "run.sh"), "#!/bin/sh\necho hi\n", 0o755)
	writeFile(t, filepath.Join(d, "data.bin"), "data", 0o644)
	writeFile(t, filepath.Join(d, "src", "main.go"), "package main\n", 0o644)
	writeFile(t, filepath.Join(d, "src", "util", "u.go"), "package util\n", 0o644)
	writeFile(t, filepath.Join(d, "docs", "a.md"), "# a\n", 0o644)
	writeFile(t, filepath.Join(d, "docs", "b.md"), "# b\n", 0o644)
	mkdirs(t, filepath.Join(d, "empty"))
	symlink(t, "README", filepath.Join(d, "link"))
}

type upperCase struct {
	name   string
	prefix string // "app" unless set; "-" means ""
	strict bool
	base   func(t testing.TB, d string) // default baseLayout
	// upper fills the upper directory; p is where the tree sits in it (u/prefix).
	upper func(t testing.TB, u, p string)
	// want turns a fresh copy of the base into the expected merged view.
	want      func(t testing.TB, w string)
	wantEmpty bool
	wantErr   error  // Upper must fail with this
	errText   string // and say this
	// kernel: mount options for checking the expectation against a real overlay that
	// uses the upper as its top (read-only) layer; "skip" where the kernel cannot say.
	kernel string
	// image, if set, fills an image layer below the base (Options.Lowers).
	image func(t testing.TB, d string)
}

// redirectOpts are the overlay options under which renamed directories and
// metadata-only copy-ups are followed.
const redirectOpts = "metacopy=on,redirect_dir=follow"

func mv(t testing.TB, from, to string) {
	t.Helper()
	mkdirs(t, filepath.Dir(to))
	if err := os.Rename(from, to); err != nil {
		t.Fatal(err)
	}
}

func chmod(t testing.TB, path string, perm os.FileMode) {
	t.Helper()
	if err := os.Chmod(path, perm); err != nil {
		t.Fatal(err)
	}
}

// metacopyFile makes what a metadata-only copy-up leaves: a sparse file of the
// origin's size with the metacopy xattr.
func metacopyFile(t testing.TB, path string, size int, perm os.FileMode) {
	t.Helper()
	writeFile(t, path, "", perm)
	if err := os.Truncate(path, int64(size)); err != nil {
		t.Fatal(err)
	}
	setXattr(t, path, "trusted.overlay.metacopy", "")
}

func upperCases() []upperCase {
	same := func(testing.TB, string) {}
	return []upperCase{
		{name: "nothing under the prefix", upper: func(t testing.TB, u, p string) {}, want: same},
		{name: "new and modified files", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src", "main.go"), "package main // edited\n", 0o644)
			writeFile(t, filepath.Join(p, "src", "util", "new.go"), "package util // new\n", 0o644)
			writeFile(t, filepath.Join(p, "NEW"), "", 0o644)
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "src", "main.go"), "package main // edited\n", 0o644)
			writeFile(t, filepath.Join(w, "src", "util", "new.go"), "package util // new\n", 0o644)
			writeFile(t, filepath.Join(w, "NEW"), "", 0o644)
		}},
		{name: "whiteout file keeps the emptied dir", upper: func(t testing.TB, u, p string) {
			whiteout(t, filepath.Join(p, "docs", "a.md"))
			whiteout(t, filepath.Join(p, "docs", "b.md"))
			whiteout(t, filepath.Join(p, "docs", "never-existed"))
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "docs", "a.md"))
			rm(t, filepath.Join(w, "docs", "b.md"))
		}},
		{name: "whiteout dir", upper: func(t testing.TB, u, p string) {
			whiteout(t, filepath.Join(p, "src"))
		}, want: func(t testing.TB, w string) { rm(t, filepath.Join(w, "src")) }},
		{name: "xattr whiteout (trusted)", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "docs", "a.md"), "", 0o644)
			setXattr(t, filepath.Join(p, "docs", "a.md"), "trusted.overlay.whiteout", "")
			setXattr(t, filepath.Join(p, "docs"), "trusted.overlay.opaque", "x") // "has xattr whiteouts", not opaque
		}, want: func(t testing.TB, w string) { rm(t, filepath.Join(w, "docs", "a.md")) }},
		{name: "xattr whiteout (user)", kernel: "userxattr", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "README"), "", 0o644)
			setXattr(t, filepath.Join(p, "README"), "user.overlay.whiteout", "")
			setXattr(t, p, "user.overlay.opaque", "x")
		}, want: func(t testing.TB, w string) { rm(t, filepath.Join(w, "README")) }},
		{name: "non-empty file with whiteout xattr is a file", kernel: "skip", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "README"), "still here\n", 0o644)
			setXattr(t, filepath.Join(p, "README"), "trusted.overlay.whiteout", "")
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "README"), "still here\n", 0o644) }},
		{name: "opaque dir replaces", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src", "only.go"), "package only\n", 0o644)
			setXattr(t, filepath.Join(p, "src"), "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "src"))
			writeFile(t, filepath.Join(w, "src", "only.go"), "package only\n", 0o644)
		}},
		{name: "opaque dir (user xattr)", kernel: "userxattr", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "docs"))
			setXattr(t, filepath.Join(p, "docs"), "user.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "docs"))
			mkdirs(t, filepath.Join(w, "docs"))
		}},
		{name: "whiteouts inside an opaque dir are no-ops", upper: func(t testing.TB, u, p string) {
			whiteout(t, filepath.Join(p, "src", "main.go"))
			writeFile(t, filepath.Join(p, "src", "x.go"), "package x\n", 0o644)
			setXattr(t, filepath.Join(p, "src"), "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "src"))
			writeFile(t, filepath.Join(w, "src", "x.go"), "package x\n", 0o644)
		}},
		{name: "plain dir merges", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src", "util", "extra.go"), "package util\n", 0o644)
			whiteout(t, filepath.Join(p, "src", "util", "u.go"))
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "src", "util", "extra.go"), "package util\n", 0o644)
			rm(t, filepath.Join(w, "src", "util", "u.go"))
		}},
		{name: "dir over a base file", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "data.bin", "inner"), "in\n", 0o644)
			mkdirs(t, filepath.Join(p, "README"))
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "data.bin"))
			writeFile(t, filepath.Join(w, "data.bin", "inner"), "in\n", 0o644)
			rm(t, filepath.Join(w, "README"))
			mkdirs(t, filepath.Join(w, "README"))
		}},
		{name: "file over a base dir", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "docs"), "now a file\n", 0o755)
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "docs"))
			writeFile(t, filepath.Join(w, "docs"), "now a file\n", 0o755)
		}},
		{name: "exec bits follow the upper", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "README"), "readme\n", 0o710)
			writeFile(t, filepath.Join(p, "run.sh"), "#!/bin/sh\necho hi\n", 0o644)
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "README"), "readme\n", 0o710)
			writeFile(t, filepath.Join(w, "run.sh"), "#!/bin/sh\necho hi\n", 0o644)
		}},
		{name: "symlinks recorded", upper: func(t testing.TB, u, p string) {
			mkdirs(t, p)
			symlink(t, "../elsewhere", filepath.Join(p, "ln"))
			symlink(t, "src", filepath.Join(p, "data.bin"))
			whiteout(t, filepath.Join(p, "link"))
		}, want: func(t testing.TB, w string) {
			symlink(t, "../elsewhere", filepath.Join(w, "ln"))
			rm(t, filepath.Join(w, "data.bin"))
			symlink(t, "src", filepath.Join(w, "data.bin"))
			rm(t, filepath.Join(w, "link"))
		}},
		{name: "symlinks with LunarStrict hide the base", strict: true, upper: func(t testing.TB, u, p string) {
			mkdirs(t, p)
			symlink(t, "../elsewhere", filepath.Join(p, "ln"))
			symlink(t, "src", filepath.Join(p, "data.bin"))
		}, want: func(t testing.TB, w string) { rm(t, filepath.Join(w, "data.bin")) }},
		{name: "special files hide the base", upper: func(t testing.TB, u, p string) {
			mkdirs(t, p)
			mkfifo(t, filepath.Join(p, "README"))
			if err := unix.Mknod(filepath.Join(p, "run.sh"), unix.S_IFCHR|0o644, int(unix.Mkdev(1, 3))); err != nil {
				t.Fatal(err)
			}
			mkfifo(t, filepath.Join(p, "newfifo"))
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "README"))
			rm(t, filepath.Join(w, "run.sh"))
		}},
		{name: "metacopy keeps the base content", kernel: "metacopy=on,redirect_dir=follow", upper: func(t testing.TB, u, p string) {
			f := filepath.Join(p, "run.sh")
			writeFile(t, f, "", 0o600)
			if err := os.Truncate(f, int64(len("#!/bin/sh\necho hi\n"))); err != nil {
				t.Fatal(err)
			}
			setXattr(t, f, "trusted.overlay.metacopy", "")
		}, want: func(t testing.TB, w string) {
			if err := os.Chmod(filepath.Join(w, "run.sh"), 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "metacopy without a base file", kernel: "skip", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src"), "", 0o644)
			setXattr(t, filepath.Join(p, "src"), "trusted.overlay.metacopy", "")
		}, errText: "metadata-only copy-up"},
		// Renamed directories (redirect_dir=on): the old code refused every one of these
		// with ErrRedirect.
		{name: "redirect dir (relative)", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src2", "added.go"), "package main // added\n", 0o644)
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.redirect", "src")
			whiteout(t, filepath.Join(p, "src"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "src2"))
			writeFile(t, filepath.Join(w, "src2", "added.go"), "package main // added\n", 0o644)
		}},
		{name: "redirect dir (absolute) into another dir", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "docs", "util2"))
			setXattr(t, filepath.Join(p, "docs", "util2"), "trusted.overlay.redirect", "/app/src/util")
			whiteout(t, filepath.Join(p, "src", "util"))
			whiteout(t, filepath.Join(p, "docs", "util2", "u.go"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src", "util"), filepath.Join(w, "docs", "util2"))
			rm(t, filepath.Join(w, "docs", "util2", "u.go"))
		}},
		{name: "redirect dir (absolute at the root prefix)", prefix: "-", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(u, "d2"))
			setXattr(t, filepath.Join(u, "d2"), "trusted.overlay.redirect", "/src/util")
			whiteout(t, filepath.Join(u, "src", "util"))
		}, want: func(t testing.TB, w string) { mv(t, filepath.Join(w, "src", "util"), filepath.Join(w, "d2")) }},
		{name: "nested redirects resolve against the parent's lower", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// mv src src2; mv src2/util src2/u2
			mkdirs(t, filepath.Join(p, "src2", "u2"))
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.redirect", "src")
			setXattr(t, filepath.Join(p, "src2", "u2"), "trusted.overlay.redirect", "util")
			whiteout(t, filepath.Join(p, "src"))
			whiteout(t, filepath.Join(p, "src2", "util"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "src2"))
			mv(t, filepath.Join(w, "src2", "util"), filepath.Join(w, "src2", "u2"))
		}},
		{name: "plain dir inside a redirected dir merges with the redirected lower", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "s", "util", "more.go"), "package util // more\n", 0o644)
			setXattr(t, filepath.Join(p, "s"), "trusted.overlay.redirect", "/app/src")
			whiteout(t, filepath.Join(p, "src"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "s"))
			writeFile(t, filepath.Join(w, "s", "util", "more.go"), "package util // more\n", 0o644)
		}},
		{name: "metacopy file inside a redirected dir", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// mv src src2; chmod 755 src2/main.go
			f := filepath.Join(p, "src2", "main.go")
			metacopyFile(t, f, len("package main\n"), 0o755)
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.redirect", "src")
			whiteout(t, filepath.Join(p, "src"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "src2"))
			chmod(t, filepath.Join(w, "src2", "main.go"), 0o755)
		}},
		{name: "metacopy file with a relative redirect inside a redirected dir", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// mv src src2; mv src2/main.go src2/m.go (metadata only)
			f := filepath.Join(p, "src2", "m.go")
			metacopyFile(t, f, len("package main\n"), 0o644)
			setXattr(t, f, "trusted.overlay.redirect", "main.go")
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.redirect", "src")
			whiteout(t, filepath.Join(p, "src"))
			whiteout(t, filepath.Join(p, "src2", "main.go"))
		}, want: func(t testing.TB, w string) {
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "src2"))
			mv(t, filepath.Join(w, "src2", "main.go"), filepath.Join(w, "src2", "m.go"))
		}},
		{name: "absolute redirect below an opaque dir", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// rm -rf docs; mkdir docs; echo > docs/new.md; mv src docs/s
			writeFile(t, filepath.Join(p, "docs", "new.md"), "new\n", 0o644)
			setXattr(t, filepath.Join(p, "docs"), "trusted.overlay.opaque", "y")
			mkdirs(t, filepath.Join(p, "docs", "s"))
			setXattr(t, filepath.Join(p, "docs", "s"), "trusted.overlay.redirect", "/app/src")
			whiteout(t, filepath.Join(p, "src"))
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "docs"))
			writeFile(t, filepath.Join(w, "docs", "new.md"), "new\n", 0o644)
			mv(t, filepath.Join(w, "src"), filepath.Join(w, "docs", "s"))
		}},
		{name: "relative redirect below an opaque dir has no lower", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "docs", "x", "only.md"), "only\n", 0o644)
			setXattr(t, filepath.Join(p, "docs"), "trusted.overlay.opaque", "y")
			setXattr(t, filepath.Join(p, "docs", "x"), "trusted.overlay.redirect", "a.md")
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "docs"))
			writeFile(t, filepath.Join(w, "docs", "x", "only.md"), "only\n", 0o644)
		}},
		{name: "opaque wins over a redirect", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src2", "only.go"), "package only\n", 0o644)
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.redirect", "src")
			setXattr(t, filepath.Join(p, "src2"), "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "src2", "only.go"), "package only\n", 0o644)
		}},
		{name: "redirect to what the base lacks or holds as a file", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "n1", "f"), "f\n", 0o644)
			setXattr(t, filepath.Join(p, "n1"), "trusted.overlay.redirect", "never-existed")
			writeFile(t, filepath.Join(p, "n2", "g"), "g\n", 0o644)
			setXattr(t, filepath.Join(p, "n2"), "trusted.overlay.redirect", "/app/README")
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "n1", "f"), "f\n", 0o644)
			writeFile(t, filepath.Join(w, "n2", "g"), "g\n", 0o644)
		}},
		{name: "the prefix itself redirected", prefix: "srv/api", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// mv /srv/api /srv/old; mv /srv/old/docs /srv/api
			mkdirs(t, filepath.Join(u, "srv", "old"), p)
			setXattr(t, filepath.Join(u, "srv", "old"), "trusted.overlay.redirect", "api")
			setXattr(t, p, "trusted.overlay.redirect", "/srv/api/docs")
		}, want: func(t testing.TB, w string) {
			clear(t, w)
			writeFile(t, filepath.Join(w, "a.md"), "# a\n", 0o644)
			writeFile(t, filepath.Join(w, "b.md"), "# b\n", 0o644)
		}},
		{name: "the prefix's ancestor redirected and the prefix untouched", prefix: "srv/api", kernel: redirectOpts, upper: func(t testing.TB, u, p string) {
			// The prefix's lower is then /srv/api/api, which the base lacks.
			mkdirs(t, filepath.Join(u, "srv"))
			setXattr(t, filepath.Join(u, "srv"), "trusted.overlay.redirect", "/srv/api")
		}, wantEmpty: true},
		{name: "the prefix's ancestor redirected outside the tree", prefix: "srv/api", kernel: "skip", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(u, "srv"))
			setXattr(t, filepath.Join(u, "srv"), "trusted.overlay.redirect", "/opt")
		}, wantErr: ErrRedirect, errText: "outside the tree"},
		{name: "redirect dir outside the tree", kernel: "skip", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "etc2"))
			setXattr(t, filepath.Join(p, "etc2"), "trusted.overlay.redirect", "/etc")
		}, wantErr: ErrRedirect, errText: "outside the tree"},
		{name: "redirect escaping with dot-dot", kernel: "skip", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "x"))
			setXattr(t, filepath.Join(p, "x"), "trusted.overlay.redirect", "/app/../etc")
		}, wantErr: ErrRedirect, errText: "not a clean path"},
		{name: "relative redirect naming a path", kernel: "skip", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "x"))
			setXattr(t, filepath.Join(p, "x"), "trusted.overlay.redirect", "src/util")
		}, wantErr: ErrRedirect, errText: "names a path"},
		{name: "empty component in a redirect", kernel: "skip", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "x"))
			setXattr(t, filepath.Join(p, "x"), "trusted.overlay.redirect", "/app//src")
		}, wantErr: ErrRedirect, errText: "not a clean path"},
		{name: "metacopy of an image file under the prefix takes the image's data", kernel: redirectOpts, image: func(t testing.TB, d string) {
			writeFile(t, filepath.Join(d, "app", "package.json"), "{}\n", 0o644)
			writeFile(t, filepath.Join(d, "etc", "hosts"), "127.0.0.1 localhost\n", 0o644)
		}, upper: func(t testing.TB, u, p string) {
			metacopyFile(t, filepath.Join(p, "package.json"), len("{}\n"), 0o755) // chmod +x
			f := filepath.Join(p, "src", "hosts")                                 // mv /etc/hosts /app/src/hosts
			metacopyFile(t, f, len("127.0.0.1 localhost\n"), 0o644)
			setXattr(t, f, "trusted.overlay.redirect", "/etc/hosts")
		}, want: func(t testing.TB, w string) {
			writeFile(t, filepath.Join(w, "package.json"), "{}\n", 0o755)
			writeFile(t, filepath.Join(w, "src", "hosts"), "127.0.0.1 localhost\n", 0o644)
		}},
		{name: "metacopy whose image origin is whited out", kernel: "skip", image: func(t testing.TB, d string) {
			whiteout(t, filepath.Join(d, "etc", "hosts"))
		}, upper: func(t testing.TB, u, p string) {
			f := filepath.Join(p, "hosts")
			metacopyFile(t, f, 3, 0o644)
			setXattr(t, f, "trusted.overlay.redirect", "/etc/hosts")
		}, errText: "no regular file at its origin"},
		{name: "metacopy file with an absolute redirect", kernel: "metacopy=on,redirect_dir=follow", upper: func(t testing.TB, u, p string) {
			f := filepath.Join(p, "src", "moved.sh") // renamed from app/run.sh while only its metadata was copied up
			writeFile(t, f, "", 0o644)
			if err := os.Truncate(f, int64(len("#!/bin/sh\necho hi\n"))); err != nil {
				t.Fatal(err)
			}
			setXattr(t, f, "trusted.overlay.metacopy", "")
			setXattr(t, f, "trusted.overlay.redirect", "/app/run.sh")
			whiteout(t, filepath.Join(p, "run.sh"))
		}, want: func(t testing.TB, w string) {
			if err := os.Rename(filepath.Join(w, "run.sh"), filepath.Join(w, "src", "moved.sh")); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(filepath.Join(w, "src", "moved.sh"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "metacopy file with a relative redirect", kernel: "metacopy=on,redirect_dir=follow", upper: func(t testing.TB, u, p string) {
			f := filepath.Join(p, "README.txt")
			writeFile(t, f, "", 0o755)
			if err := os.Truncate(f, int64(len("readme\n"))); err != nil {
				t.Fatal(err)
			}
			setXattr(t, f, "trusted.overlay.metacopy", "")
			setXattr(t, f, "trusted.overlay.redirect", "README")
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "README.txt"), "readme\n", 0o755) }},
		{name: "metacopy file redirected outside the prefix", kernel: "skip", upper: func(t testing.TB, u, p string) {
			f := filepath.Join(p, "hosts")
			writeFile(t, f, "", 0o644)
			setXattr(t, f, "trusted.overlay.metacopy", "")
			setXattr(t, f, "trusted.overlay.redirect", "/etc/hosts")
		}, errText: "outside the tree"},
		{name: "redirect on a complete file is ignored", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "moved"), "own data\n", 0o644)
			setXattr(t, filepath.Join(p, "moved"), "trusted.overlay.redirect", "/app/README")
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "moved"), "own data\n", 0o644) }},
		{name: "prefix whited out", upper: func(t testing.TB, u, p string) { whiteout(t, p) }, wantEmpty: true},
		{name: "prefix ancestor whited out", prefix: "srv/api", upper: func(t testing.TB, u, p string) {
			whiteout(t, filepath.Join(u, "srv"))
		}, wantEmpty: true},
		{name: "prefix replaced by a file", upper: func(t testing.TB, u, p string) {
			writeFile(t, p, "gone\n", 0o644)
		}, wantEmpty: true},
		{name: "prefix ancestor opaque without the prefix", prefix: "srv/api", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(u, "srv", "other"), "x", 0o644)
			setXattr(t, filepath.Join(u, "srv"), "trusted.overlay.opaque", "y")
		}, wantEmpty: true},
		{name: "prefix ancestor opaque with the prefix", prefix: "srv/api", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "only.txt"), "only\n", 0o644)
			setXattr(t, filepath.Join(u, "srv"), "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			clear(t, w)
			writeFile(t, filepath.Join(w, "only.txt"), "only\n", 0o644)
		}},
		{name: "prefix opaque", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "fresh", "start.txt"), "fresh\n", 0o644)
			setXattr(t, p, "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) {
			clear(t, w)
			writeFile(t, filepath.Join(w, "fresh", "start.txt"), "fresh\n", 0o644)
		}},
		{name: "root prefix ignores opaque on the upper root", prefix: "-", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(u, "top.txt"), "top\n", 0o644)
			setXattr(t, u, "trusted.overlay.opaque", "y")
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "top.txt"), "top\n", 0o644) }},
		{name: "deep prefix merges", prefix: "srv/api", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "docs", "c.md"), "# c\n", 0o644)
			writeFile(t, filepath.Join(u, "srv", "other"), "outside the prefix\n", 0o644)
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "docs", "c.md"), "# c\n", 0o644) }},
		{name: ".git in the upper is skipped", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, ".git", "HEAD"), "ref\n", 0o644)
			writeFile(t, filepath.Join(p, "src", ".git"), "gitdir: x\n", 0o644)
			writeFile(t, filepath.Join(p, ".gitignore"), "*.o\n", 0o644)
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, ".gitignore"), "*.o\n", 0o644) }},
		{name: "new empty dirs are kept", upper: func(t testing.TB, u, p string) {
			mkdirs(t, filepath.Join(p, "new", "deeper"), filepath.Join(p, "empty", "inner"))
		}, want: func(t testing.TB, w string) {
			mkdirs(t, filepath.Join(w, "new", "deeper"), filepath.Join(w, "empty", "inner"))
		}},
		{name: "lossy name in the upper", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "src", "n\xffx"), "bytes\n", 0o644)
		}, want: func(t testing.TB, w string) { writeFile(t, filepath.Join(w, "src", "n\uFFFDx"), "bytes\n", 0o644) }},
		{name: "upper name collides with a base name", base: lossyBase, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "n\xffx"), "raw\n", 0o644)
		}, wantErr: ErrNameCollision, errText: `"n\xffx"`},
		{name: "upper names collide", upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "docs", "n\xffx"), "1\n", 0o644)
			writeFile(t, filepath.Join(p, "docs", "n\xfex"), "2\n", 0o644)
		}, wantErr: ErrNameCollision, errText: "docs"},
		{name: "whiteout resolves a collision", base: lossyBase, upper: func(t testing.TB, u, p string) {
			writeFile(t, filepath.Join(p, "n\xffx"), "raw\n", 0o644)
			whiteout(t, filepath.Join(p, "n\uFFFDx"))
		}, want: func(t testing.TB, w string) {
			rm(t, filepath.Join(w, "n\uFFFDx"))
			writeFile(t, filepath.Join(w, "n\xffx"), "raw\n", 0o644)
		}},
	}
}

func lossyBase(t testing.TB, d string) {
	baseLayout(t, d)
	writeFile(t, filepath.Join(d, "n\uFFFDx"), "converted\n", 0o644)
}

// clear empties a directory.
func clear(t testing.TB, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		rm(t, filepath.Join(dir, e.Name()))
	}
}

// TestUpperRules checks each overlay rule on a hand-made upper directory against a
// hand-made expected tree, and (as root) checks that expectation against the kernel by
// mounting the upper as the top layer of a read-only overlay over the base.
func TestUpperRules(t *testing.T) {
	requireRoot(t) // whiteouts are device nodes, opaque markers trusted.* xattrs
	for _, c := range upperCases() {
		t.Run(c.name, func(t *testing.T) {
			prefix := c.prefix
			switch prefix {
			case "":
				prefix = "app"
			case "-":
				prefix = ""
			}
			opts := Options{LunarStrict: c.strict}
			layout := c.base
			if layout == nil {
				layout = baseLayout
			}
			tmp := t.TempDir()
			s := casstoretest.NewStore(t)
			src := filepath.Join(tmp, "src")
			layout(t, src)
			base := mustDir(t, s, src, opts)

			u := filepath.Join(tmp, "upper")
			p := filepath.Join(u, prefix)
			mkdirs(t, u)
			if prefix != "" { // changes outside the prefix, which Upper must ignore
				writeFile(t, filepath.Join(u, "etc", "hostname"), "box\n", 0o644)
				whiteout(t, filepath.Join(u, "zz"))
			}
			c.upper(t, u, p)
			var layers []string
			if c.image != nil {
				img := filepath.Join(tmp, "image")
				mkdirs(t, img)
				c.image(t, img)
				layers = []string{img}
				opts.Lowers = layers
			}

			before := objects(t, s)
			got, err := Upper(t.Context(), s, base, u, prefix, opts)

			var want casstore.Hash
			switch {
			case c.wantErr != nil || c.errText != "":
				if err == nil {
					t.Fatalf("Upper succeeded with %s, want an error", got)
				}
				if c.wantErr != nil && !errors.Is(err, c.wantErr) {
					t.Errorf("err = %v, want %v", err, c.wantErr)
				}
				if !strings.Contains(err.Error(), c.errText) {
					t.Errorf("err = %v, want it to mention %s", err, c.errText)
				}
				if after := objects(t, s); !slices.Equal(before, after) {
					t.Errorf("failed commit changed the store: %d -> %d objects", len(before), len(after))
				}
			case c.wantEmpty:
				if err != nil {
					t.Fatal(err)
				}
				want = casstore.EmptyHash
				if ok, _ := s.Has(want); !ok {
					t.Error("the empty tree object was not stored")
				}
			default:
				if err != nil {
					t.Fatal(err)
				}
				w := filepath.Join(tmp, "want")
				layout(t, w)
				c.want(t, w)
				want = mustDir(t, s, w, opts)
			}
			if err == nil && got != want {
				t.Fatalf("Upper = %s, want %s\n%s", got, want, diffListings(listing(t, s, want), listing(t, s, got)))
			}

			if c.kernel == "skip" {
				return
			}
			// The kernel's merged view of the same layers must agree with the expectation.
			lower := filepath.Join(tmp, "lower")
			mkdirs(t, filepath.Dir(filepath.Join(lower, prefix)))
			checkout(t, s, base, filepath.Join(lower, prefix))
			merged := filepath.Join(tmp, "merged")
			mkdirs(t, merged)
			if err := mountOverlay(t, merged, append([]string{u, lower}, layers...), "", "", c.kernel); err != nil {
				t.Fatal(err)
			}
			mp := filepath.Join(merged, prefix)
			if c.wantEmpty {
				if st, err := os.Lstat(mp); err == nil && st.IsDir() {
					t.Fatalf("kernel shows %s as a directory; the case expects it gone", mp)
				}
				return
			}
			kh, _, kerr := Dir(t.Context(), s, mp, opts)
			if c.wantErr != nil {
				if !errors.Is(kerr, c.wantErr) {
					t.Fatalf("Dir(kernel merged) err = %v, want %v", kerr, c.wantErr)
				}
				return
			}
			if kerr != nil {
				t.Fatal(kerr)
			}
			if kh != want {
				t.Fatalf("kernel merged view %s differs from the expectation %s\n%s", kh, want, diffListings(listing(t, s, want), listing(t, s, kh)))
			}
		})
	}
}

func TestUpperArguments(t *testing.T) {
	s := casstoretest.NewStore(t)
	base := mustDir(t, s, t.TempDir(), Options{})
	u := t.TempDir()
	for _, bad := range []string{"/app", "../x", "a/../b"} {
		if _, err := Upper(t.Context(), s, base, u, bad, Options{}); err == nil {
			t.Errorf("prefix %q accepted", bad)
		}
	}
	if _, err := Upper(t.Context(), s, casstore.Hash{}, u, "", Options{}); err == nil {
		t.Error("zero base accepted")
	}
	missing := casstore.Sum([]byte("not in the store"))
	if _, err := Upper(t.Context(), s, missing, u, "", Options{}); err == nil || !strings.Contains(err.Error(), missing.Short()) {
		t.Errorf("base missing from the store: err = %v", err)
	}
	if _, err := Upper(t.Context(), s, base, filepath.Join(u, "nope"), "", Options{}); err == nil {
		t.Error("missing upper dir accepted")
	}
}
