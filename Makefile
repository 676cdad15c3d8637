# Tidepool build, set-up and test entry points. `make deps` then `make demo` or
# `make test` is the whole set-up on a fresh Debian machine (as root).

GO            ?= go
DEPS_BIN      := $(CURDIR)/.deps/bin
BIN           := $(CURDIR)/bin
CONTAINERD_VERSION := v2.4.2
RUNC_VERSION       := v1.5.2
# MinIO, the real S3 server the remote tests and benchmarks start per test (pinned pseudo-version)
MINIO_VERSION      := v0.0.0-20260212201848-7aac2a2c5b7c
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
DEBIAN_PACKAGES := libseccomp-dev pkg-config fuse3 umoci busybox-static runsc git ca-certificates xz-utils

export PATH := $(BIN):$(DEPS_BIN):$(PATH)
export TIDEPOOL_BIN := $(BIN)
export TIDEPOOL_DEPS_BIN := $(DEPS_BIN)

GO_TEST_FLAGS ?= -race -count=1 -timeout 30m

.PHONY: all build deps test unit-test demo bench fuzz proto clean

all: build

## build: compile tidepool, tidepoold and the shim into ./bin
build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/...

## deps: install every tool the tests need (idempotent, pinned). Needs root on Debian.
deps: $(DEPS_BIN)/.containerd-$(CONTAINERD_VERSION) $(DEPS_BIN)/.runc-$(RUNC_VERSION) $(DEPS_BIN)/.minio-$(MINIO_VERSION) .deps/.apt

.deps/.apt:
	@mkdir -p .deps
	@missing=""; for p in $(DEBIAN_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
	@command -v node >/dev/null && command -v npm >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nodejs npm; }
	@touch $@

$(DEPS_BIN)/.containerd-$(CONTAINERD_VERSION): .deps/.apt
	@mkdir -p $(DEPS_BIN)
	GOBIN=$(DEPS_BIN) $(GO) install \
		github.com/containerd/containerd/v2/cmd/containerd@$(CONTAINERD_VERSION) \
		github.com/containerd/containerd/v2/cmd/ctr@$(CONTAINERD_VERSION) \
		github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$(CONTAINERD_VERSION)
	@touch $@

$(DEPS_BIN)/.runc-$(RUNC_VERSION): .deps/.apt
	@mkdir -p $(DEPS_BIN)
	GOBIN=$(DEPS_BIN) $(GO) install -tags seccomp github.com/opencontainers/runc@$(RUNC_VERSION)
	@touch $@

$(DEPS_BIN)/.minio-$(MINIO_VERSION):
	@mkdir -p $(DEPS_BIN)
	GOBIN=$(DEPS_BIN) $(GO) install github.com/minio/minio@$(MINIO_VERSION)
	@touch $@

## demo: the main job end to end on an embedded default (own containerd + tidepoold
## under a temp dir, a locally built image, the Go source tree as the fork), narrated
demo: deps build
	$(GO) test -count=1 -v -timeout 20m -run '^TestDemo$$' ./integration/demo/

## test: every test, unit and real-stack, with the race detector (root runs them all);
## views.mode auto (kernel views where the kernel has them), then the snapshotter and
## real-stack tests again with FUSE views
test: deps build
	$(GO) vet ./...
	$(GO) test $(GO_TEST_FLAGS) ./...
	TIDEPOOL_VIEWS_MODE=fuse $(GO) test $(GO_TEST_FLAGS) ./snapshotter/ ./integration/e2e/

## unit-test: the tests that need neither root nor the installed tools
unit-test:
	$(GO) test -race -count=1 -short ./...

## bench: the benchmarks, each reporting ratios against its baseline in the same run
bench: build
	$(GO) test -run '^$$' -bench . -benchtime 5x -timeout 60m ./...

## fuzz: run the tree decoder fuzzer for a minute
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecodeTree -fuzztime 60s ./casstore/

clean:
	rm -rf $(BIN)

## proto: regenerate api/v1 from its .proto (needs protoc; the generated code is committed)
proto:
	GOBIN=$(DEPS_BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(DEPS_BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	protoc -I api/v1 -I /usr/include --go_out=paths=source_relative:api/v1 \
		--go-grpc_out=paths=source_relative:api/v1 api/v1/tidepool.proto
