/*
 * faultfs: an LD_PRELOAD shim that makes a process's files as fragile as a
 * real disk's, for crash tests (in the spirit of LazyFS, without FUSE).
 *
 * It watches the regular files directly inside the directory named by
 * FAULTFS_DIR, and keeps, in FAULTFS_DIR.durable/, what of each would
 * survive a power loss: a copy of the file as it was at its last fsync (or
 * fdatasync). After the process is killed, keel_testkit::faultfs restores
 * those copies over the directory: every write not yet fsynced is lost, as
 * a power cut loses the page cache. A file never fsynced does not survive;
 * an unlink is durable at once (so a restore never brings back a journal
 * that SQLite deleted).
 *
 * Faults, each armed by the environment:
 *   FAULTFS_KILL_AT_SYNC=N   SIGKILL the process inside its Nth fsync of a
 *                            watched file, before that fsync made anything
 *                            durable: the crash between a COMMIT's write and
 *                            its sync.
 *   FAULTFS_FULL=PATH        while PATH exists, every write to a watched
 *                            file fails with ENOSPC, as on a full disk; its
 *                            removal is the disk growing again.
 *
 * Only the libc entry points SQLite's unix VFS uses are wrapped: write,
 * pwrite, pwrite64, fsync, fdatasync, unlink, unlinkat.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static atomic_long syncs;

/* One copy at a time: a copy reads the file as it is when it runs, so with
 * the copies in turn the last one to finish is also the newest, and a
 * durable copy never goes back to an older state (two connections of one
 * database fsync its WAL from different threads). */
static pthread_mutex_t copying = PTHREAD_MUTEX_INITIALIZER;

static const char *watched_dir(void) {
    const char *dir = getenv("FAULTFS_DIR");
    return (dir && *dir) ? dir : NULL;
}

/* Whether `path` is a file directly inside the watched directory; if so,
 * its name. */
static const char *watched_name(const char *path) {
    const char *dir = watched_dir();
    if (!dir || !path) return NULL;
    size_t len = strlen(dir);
    if (strncmp(path, dir, len) != 0 || path[len] != '/') return NULL;
    const char *name = path + len + 1;
    if (!*name || strchr(name, '/')) return NULL;
    /* An open file already unlinked: nothing of it can survive. */
    size_t n = strlen(name);
    const char *deleted = " (deleted)";
    if (n > strlen(deleted) && strcmp(name + n - strlen(deleted), deleted) == 0) return NULL;
    return name;
}

/* The path `fd` was opened at, if it is a watched file. */
static const char *fd_name(int fd, char *buf, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, buf, size - 1);
    if (n <= 0) return NULL;
    buf[n] = '\0';
    return watched_name(buf);
}

static void shadow_path(const char *name, char *out, size_t size) {
    snprintf(out, size, "%s.durable/%s", watched_dir(), name);
}

/* Copies the file at `path` over its shadow, atomically (tmp + rename). */
static int make_durable(const char *path, const char *name) {
    char shadow[PATH_MAX], tmp[PATH_MAX + 32];
    shadow_path(name, shadow, sizeof shadow);
    /* A name no watched file has: a copy cut short by a kill is skipped. */
    snprintf(tmp, sizeof tmp, "%s.durable/.partial-%d-%s", watched_dir(), (int)gettid(), name);
    int in = open(path, O_RDONLY | O_CLOEXEC);
    if (in < 0) return -1;
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) { close(in); return -1; }
    static ssize_t (*real_write)(int, const void *, size_t);
    if (!real_write) real_write = dlsym(RTLD_NEXT, "write");
    char buf[1 << 16];
    ssize_t n;
    int failed = 0;
    while ((n = read(in, buf, sizeof buf)) > 0) {
        if (real_write(out, buf, (size_t)n) != n) { failed = 1; break; }
    }
    close(in);
    close(out);
    if (n < 0 || failed || rename(tmp, shadow) != 0) { unlink(tmp); return -1; }
    return 0;
}

static int is_full(void) {
    const char *flag = getenv("FAULTFS_FULL");
    return flag && *flag && access(flag, F_OK) == 0;
}

static int refuse_write(int fd) {
    char buf[PATH_MAX];
    if (!is_full() || !fd_name(fd, buf, sizeof buf)) return 0;
    errno = ENOSPC;
    return 1;
}

static int synced(int fd, int (*real)(int)) {
    char buf[PATH_MAX];
    const char *name = fd_name(fd, buf, sizeof buf);
    if (name) {
        long n = atomic_fetch_add(&syncs, 1) + 1;
        const char *kill_at = getenv("FAULTFS_KILL_AT_SYNC");
        if (kill_at && *kill_at && atol(kill_at) == n) kill(getpid(), SIGKILL);
    }
    int rc = real(fd);
    if (rc == 0 && name) {
        pthread_mutex_lock(&copying);
        int copied = make_durable(buf, name);
        pthread_mutex_unlock(&copying);
        if (copied != 0) {
            errno = EIO;
            return -1;
        }
    }
    return rc;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    return synced(fd, real);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    return synced(fd, real);
}

ssize_t write(int fd, const void *data, size_t len) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "write");
    if (refuse_write(fd)) return -1;
    return real(fd, data, len);
}

ssize_t pwrite(int fd, const void *data, size_t len, off_t at) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite");
    if (refuse_write(fd)) return -1;
    return real(fd, data, len, at);
}

ssize_t pwrite64(int fd, const void *data, size_t len, off64_t at) {
    static ssize_t (*real)(int, const void *, size_t, off64_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite64");
    if (refuse_write(fd)) return -1;
    return real(fd, data, len, at);
}

static void forget(const char *path) {
    const char *name = watched_name(path);
    if (!name) return;
    char shadow[PATH_MAX];
    shadow_path(name, shadow, sizeof shadow);
    static int (*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "unlink");
    real(shadow);
}

int unlink(const char *path) {
    static int (*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "unlink");
    int rc = real(path);
    if (rc == 0) forget(path);
    return rc;
}

int unlinkat(int dirfd, const char *path, int flags) {
    static int (*real)(int, const char *, int);
    if (!real) real = dlsym(RTLD_NEXT, "unlinkat");
    int rc = real(dirfd, path, flags);
    if (rc == 0 && path[0] == '/') forget(path);
    return rc;
}
