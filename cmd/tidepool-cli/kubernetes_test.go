package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const kubeDir = "../../contrib/kubernetes"

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// decodeManifest decodes every document of a YAML file strictly (unknown or
// duplicate fields fail) into the k8s.io/api type its kind names.
func decodeManifest(data []byte) ([]any, error) {
	var out []any
	for _, doc := range docSep.Split(string(data), -1) {
		if strings.TrimSpace(regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(doc, "")) == "" {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return nil, err
		}
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 Namespace":
			obj = &corev1.Namespace{}
		case "v1 Pod":
			obj = &corev1.Pod{}
		case "apps/v1 DaemonSet":
			obj = &appsv1.DaemonSet{}
		case "node.k8s.io/v1 RuntimeClass":
			obj = &nodev1.RuntimeClass{}
		default:
			return nil, &unknownKind{tm.APIVersion, tm.Kind}
		}
		// As the API server decodes: YAML to JSON, then sigs.k8s.io/json, which is
		// case-sensitive (encoding/json would take hostPid for hostPID).
		js, err := yaml.YAMLToJSONStrict([]byte(doc))
		if err != nil {
			return nil, err
		}
		strict, err := kjson.UnmarshalStrict(js, obj, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
		if err != nil {
			return nil, err
		}
		if len(strict) > 0 {
			return nil, fmt.Errorf("%s %s: %v", tm.Kind, tm.APIVersion, strict)
		}
		out = append(out, obj)
	}
	return out, nil
}

type unknownKind struct{ apiVersion, kind string }

func (u *unknownKind) Error() string { return "no decoder for " + u.apiVersion + " " + u.kind }

func TestKubernetesManifestsDecodeStrictly(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(kubeDir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", kubeDir, err)
	}
	var ds *appsv1.DaemonSet
	var rc *nodev1.RuntimeClass
	var pods []*corev1.Pod
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeManifest(data)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, o := range objs {
			switch o := o.(type) {
			case *appsv1.DaemonSet:
				ds = o
			case *nodev1.RuntimeClass:
				rc = o
			case *corev1.Pod:
				pods = append(pods, o)
			}
		}
	}
	if ds == nil || rc == nil {
		t.Fatalf("want a DaemonSet and a RuntimeClass (DaemonSet %v, RuntimeClass %v)", ds != nil, rc != nil)
	}
	// The RuntimeClass names the CRI handler install's drop-in defines, and pods
	// use it.
	if !strings.Contains(dropIn(3, "linux/amd64"), "containerd.runtimes."+rc.Handler+"]") {
		t.Errorf("RuntimeClass handler %q is not a runtime of the drop-in install writes", rc.Handler)
	}
	for _, p := range pods {
		if p.Spec.RuntimeClassName == nil || *p.Spec.RuntimeClassName != rc.Name {
			t.Errorf("pod %s does not use RuntimeClass %s", p.Name, rc.Name)
		}
	}
	checkDaemonSet(t, ds)
}

// checkDaemonSet parses the container's command with the real CLI and checks that
// the pod gives `tidepool install` what it needs.
func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet) {
	spec := ds.Spec.Template.Spec
	if sel := ds.Spec.Selector; sel == nil || sel.MatchLabels["app.kubernetes.io/name"] != ds.Spec.Template.Labels["app.kubernetes.io/name"] {
		t.Errorf("selector %v does not match the template's labels %v", sel, ds.Spec.Template.Labels)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("want one container, have %d", len(spec.Containers))
	}
	c := spec.Containers[0]
	argv := append(append([]string{}, c.Command...), c.Args...)
	if len(argv) < 2 || filepath.Base(argv[0]) != "tidepool" {
		t.Fatalf("command %q does not run tidepool", argv)
	}
	root := newRootCommand()
	cmd, rest, err := root.Find(argv[1:])
	if err != nil || cmd.Name() != "install" {
		t.Fatalf("command %q is not `tidepool install`: %v", argv, err)
	}
	if err := cmd.ParseFlags(rest); err != nil {
		t.Fatalf("command %q: %v", argv, err)
	}
	hostRoot, _ := cmd.Flags().GetString("host-root")
	restart, _ := cmd.Flags().GetBool("restart-containerd")
	wait, _ := cmd.Flags().GetBool("wait")
	from, _ := cmd.Flags().GetString("from")
	if hostRoot == "/" || !filepath.IsAbs(hostRoot) {
		t.Errorf("--host-root %q: want the node's root mounted at an absolute path", hostRoot)
	}
	if !wait {
		t.Error("without --wait the container exits and the DaemonSet restarts it forever")
	}
	// --from defaults to the directory of the binary the command runs: the image
	// must hold every binary there (the Dockerfile copies them).
	if from == "" {
		from = filepath.Dir(argv[0])
	}
	dockerfile, err := os.ReadFile(filepath.Join(kubeDir, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range installBinaries {
		if !bytes.Contains(dockerfile, []byte("bin/"+b+" ")) && !bytes.Contains(dockerfile, []byte("bin/"+b+"\n")) {
			t.Errorf("Dockerfile does not copy %s", b)
		}
	}
	if !bytes.Contains(dockerfile, []byte(" "+from+"/")) {
		t.Errorf("Dockerfile does not put the binaries in %s", from)
	}
	// The host root: a hostPath volume of the node's / mounted read-write at --host-root.
	var mount *corev1.VolumeMount
	for i := range c.VolumeMounts {
		if filepath.Clean(c.VolumeMounts[i].MountPath) == filepath.Clean(hostRoot) {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil {
		t.Fatalf("no volume is mounted at --host-root %s", hostRoot)
	}
	if mount.ReadOnly || mount.SubPath != "" {
		t.Errorf("host root mount %+v: install writes under it", mount)
	}
	var vol *corev1.Volume
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == mount.Name {
			vol = &spec.Volumes[i]
		}
	}
	if vol == nil || vol.HostPath == nil || vol.HostPath.Path != "/" {
		t.Fatalf("volume %q is not the node's / (hostPath): %+v", mount.Name, vol)
	}
	// --restart-containerd runs systemctl in the node's namespaces through pid 1.
	if restart {
		if !spec.HostPID {
			t.Error("--restart-containerd needs hostPID (nsenter --target 1)")
		}
		if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
			t.Error("--restart-containerd needs a privileged container (nsenter into pid 1's mount namespace)")
		}
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the installer never talks to the API server: do not mount a token")
	}
}

// The strict decoder is strict: an unknown field and an unknown kind fail.
func TestDecodeManifestRejectsUnknownFields(t *testing.T) {
	bad := "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      hostPid: true\n"
	if _, err := decodeManifest([]byte(bad)); err == nil || !strings.Contains(err.Error(), "hostPid") {
		t.Fatalf("unknown field: %v", err)
	}
	if _, err := decodeManifest([]byte("apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata:\n  name: x\nhandler: x\nfooBar: 1\n")); err == nil || !strings.Contains(err.Error(), "fooBar") {
		t.Fatalf("unknown field: %v", err)
	}
	if _, err := decodeManifest([]byte("apiVersion: v1\nkind: Secret\n")); err == nil {
		t.Fatal("unknown kind decoded")
	}
}
