/* The template's fork loop, in C so that no Python runs in the template once the tool is
 * imported: an audit hook, a patched os.fork, an at-fork callback or a signal handler the
 * import left has nothing to run on. Loaded by bench/_fork_template.py with ctypes.PyDLL
 * (the GIL stays held, no other thread exists) and built by bench/fork_floor.py:
 *
 *     cc -O2 -shared -fPIC -o _fork_loop.so _fork_loop.c
 *
 * runner_fork_loop(control) never returns in the template. It returns 1 in a call's init,
 * once the call is sealed and holds its stdio: Python then runs the tool's main.
 * Everything from the runner's side (the seccomp program, the tool's folder) comes over
 * the control socket, sent by the benchmark after it has checked the template from outside.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_SETUP 125   /* a step before the tool's code failed (as the Python loop) */
#define EXIT_THREADS 121 /* the import left a thread running */
#define EXIT_SHARED 122  /* a shared mapping could not be removed */
#define EXIT_CONFIG 123  /* the runner's configuration did not arrive whole */
#define FRESH (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS)
#define HIGH_FD 64 /* received descriptors are parked here before taking 0-2 */

void PyOS_AfterFork_Child(void); /* exported by the interpreter that loaded us */

static sigset_t saved_mask;
static struct sock_fprog program;
static char tool_dir[4096];

static ssize_t read_all(const char *path, char **out) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t size = 0, cap = 1 << 16;
    char *buf = malloc(cap + 1);
    for (ssize_t got; buf; size += (size_t)got) {
        if (size == cap) buf = realloc(buf, (cap *= 2) + 1);
        if (!buf || (got = read(fd, buf + size, cap - size)) <= 0) break;
    }
    close(fd);
    if (!buf) return -1;
    buf[size] = 0;
    *out = buf;
    return (ssize_t)size;
}

static int only_thread(void) {
    char *status;
    if (read_all("/proc/self/status", &status) < 0) return 0;
    int one = strstr(status, "\nThreads:\t1\n") != NULL;
    free(status);
    return one;
}

/* Whether a /proc/self/maps line is memory another process could also reach: MAP_SHARED,
 * or a view of a shm file, memfd or SysV segment (even a private one: its page cache is
 * the file's, so whoever can write the file shows a call new bytes). */
static int shared(const char *perms, const char *path) {
    return perms[3] == 's' || !strncmp(path, "/dev/shm/", 9) || !strncmp(path, "/memfd:", 7) ||
           !strncmp(path, "/SYSV", 5);
}

/* Unmaps every shared mapping; returns how many were left (read back afterwards). */
static int unmap_shared(int unmap) {
    char *maps, *line, *next;
    int left = 0;
    if (read_all("/proc/self/maps", &maps) < 0) return -1;
    for (line = maps; *line; line = next) {
        next = strchr(line, '\n');
        next = next ? next + 1 : line + strlen(line);
        unsigned long start, end;
        char perms[5] = "", path[256] = "";
        if (sscanf(line, "%lx-%lx %4s %*s %*s %*s %255s", &start, &end, perms, path) < 3) continue;
        if (!shared(perms, path)) continue;
        if (unmap) munmap((void *)start, end - start);
        left++;
    }
    free(maps);
    return left;
}

static int send_bytes(int sock, const void *data, size_t len) {
    return send(sock, data, len, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -1;
}

/* Receives one message of at least one byte; its descriptors (up to max) into fds. */
static ssize_t receive(int sock, void *data, size_t len, int *fds, int max, int *nfds) {
    char control[CMSG_SPACE(16 * sizeof(int))];
    struct iovec iov = {data, len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = CMSG_SPACE((size_t)max * sizeof(int))};
    ssize_t got;
    do got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    while (got < 0 && errno == EINTR);
    *nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (*nfds < max) fds[(*nfds)++] = fd;
            else close(fd);
        }
    }
    return got;
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) _exit(EXIT_SETUP);
    close(fd);
}

/* The tool's folder as cwd, entered first: it lies under /tmp (a bind, read-only), and the
 * import may have left the template anywhere. Then fresh /tmp, /dev/shm, /dev/pts and
 * /proc, no new privileges, the runner's filter: what the tool's code runs under. */
static void seal(void) {
    if (chdir(tool_dir) || mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) ||
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777") ||
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777") ||
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") ||
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) ||
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program))
        _exit(EXIT_SETUP);
}

/* The call's first process: joins its cgroup, unshares, forks the call's init and reports
 * its wait status. Returns only in the init, sealed, with stdio in place. */
static int call(int own) {
    int fds[16], n;
    char byte;
    int given = own;
    own = fcntl(given, F_DUPFD_CLOEXEC, HIGH_FD + 3); /* above the three parked ones */
    close(given);
    struct ucred creds = {getpid(), getuid(), getgid()};
    char control[CMSG_SPACE(sizeof creds)];
    struct iovec iov = {"p", 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_CREDENTIALS, c->cmsg_len = CMSG_LEN(sizeof creds);
    memcpy(CMSG_DATA(c), &creds, sizeof creds);
    if (own < 0 || sendmsg(own, &msg, MSG_NOSIGNAL) != 1) _exit(EXIT_SETUP);
    if (receive(own, &byte, 1, fds, 16, &n) != 1) _exit(EXIT_SETUP);
    for (int i = 0; i < n; i++) {
        if (write(fds[i], "0", 1) != 1) _exit(EXIT_SETUP); /* joins the call cgroup */
        close(fds[i]);
    }
    char map[64];
    uid_t uid = getuid();
    gid_t gid = getgid();
    if (unshare(FRESH)) _exit(EXIT_SETUP);
    /* The template is not dumpable (no process of its uid may trace it); its own maps
     * need the process dumpable to be written, so for these three writes only. */
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "%u %u 1", uid, uid);
    write_file("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "%u %u 1", gid, gid);
    write_file("/proc/self/gid_map", map);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    pid_t init = fork();
    if (init < 0) _exit(EXIT_SETUP);
    if (init) {
        int status;
        while (waitpid(init, &status, 0) < 0)
            if (errno != EINTR) _exit(EXIT_SETUP);
        send_bytes(own, &status, sizeof status);
        _exit(0);
    }
    seal();
    if (send_bytes(own, "s", 1)) _exit(EXIT_SETUP);
    if (receive(own, &byte, 1, fds, 3, &n) != 1 || n != 3) _exit(EXIT_SETUP);
    close(own);
    /* Parked high first: a received descriptor may already sit on 0, 1 or 2. */
    for (int i = 0; i < 3; i++) {
        if (dup3(fds[i], HIGH_FD + i, O_CLOEXEC) < 0) _exit(EXIT_SETUP);
        close(fds[i]);
    }
    for (int i = 0; i < 3; i++) {
        if (dup2(HIGH_FD + i, i) < 0) _exit(EXIT_SETUP);
        close(HIGH_FD + i);
    }
    /* The call's code only from here: what it installed at import may run now, sealed. */
    sigprocmask(SIG_SETMASK, &saved_mask, NULL);
    PyOS_AfterFork_Child();
    return 1;
}

int runner_fork_loop(int control) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &saved_mask); /* no handler the import set runs here */
    if (!only_thread()) _exit(EXIT_THREADS);
    if (control < 3 || syscall(SYS_close_range, 0, control - 1, 0) ||
        syscall(SYS_close_range, control + 1, ~0U, 0))
        _exit(EXIT_SETUP);
    unmap_shared(1);
    if (unmap_shared(0) != 0) _exit(EXIT_SHARED);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Ready: the benchmark checks the template from outside, then sends its configuration:
     * the filter's length (4 bytes), the filter, the tool's folder (NUL-terminated). */
    if (send_bytes(control, "r", 1)) _exit(EXIT_CONFIG);
    static char config[1 << 17];
    int fds[1], n;
    uint32_t length;
    ssize_t got = receive(control, config, sizeof config - 1, fds, 0, &n);
    if (got < 4) _exit(EXIT_CONFIG);
    memcpy(&length, config, 4);
    if (length % 8 || length / 8 > 0xffff || 4 + (size_t)length >= (size_t)got) _exit(EXIT_CONFIG);
    config[got] = 0;
    program.len = (unsigned short)(length / 8);
    program.filter = malloc(length);
    memcpy(program.filter, config + 4, length);
    snprintf(tool_dir, sizeof tool_dir, "%s", config + 4 + length);
    for (;;) {
        char tag;
        int call_fd;
        got = receive(control, &tag, 1, &call_fd, 1, &n);
        if (got <= 0) _exit(0); /* the runner closed the control socket */
        if (n != 1) continue;
        pid_t pid = fork();
        if (pid == 0) {
            close(control);
            return call(call_fd);
        }
        close(call_fd);
        while (waitpid(-1, NULL, WNOHANG) > 0) /* calls that ended: nothing kept of them */
            ;
    }
}
