/* Raw Linux system calls for pytest-boxlite's native pid 1 (x86_64 and aarch64).
 *
 * No libc: boxinit.c is a freestanding static executable (it runs in any box, whatever C library
 * the box has), and boxclone.c's pid 1 shares the warm interpreter's memory and thread pointer, so
 * it must not write libc's errno, which belongs to the suspended interpreter thread.  Each call
 * returns the result or -errno. */
#ifndef BOXLITE_SYS_H
#define BOXLITE_SYS_H

#if defined(__x86_64__)
#define NR_read 0
#define NR_write 1
#define NR_close 3
#define NR_rt_sigaction 13
#define NR_rt_sigprocmask 14
#define NR_pipe2 293
#define NR_clone 56
#define NR_wait4 61
#define NR_kill 62
#define NR_fcntl 72
#define NR_prctl 157
#define NR_exit_group 231
#define NR_openat 257
#define NR_rt_sigtimedwait 128
#define NR_execveat 322
#define NR_close_range 436
static inline long sys6(long n, long a, long b, long c, long d, long e, long f)
{
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
#define NR_read 63
#define NR_write 64
#define NR_close 57
#define NR_rt_sigaction 134
#define NR_rt_sigprocmask 135
#define NR_pipe2 59
#define NR_clone 220
#define NR_wait4 260
#define NR_kill 129
#define NR_fcntl 25
#define NR_prctl 167
#define NR_exit_group 94
#define NR_openat 56
#define NR_rt_sigtimedwait 137
#define NR_execveat 281
#define NR_close_range 436
static inline long sys6(long n, long a, long b, long c, long d, long e, long f)
{
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
}
#else
#error "pytest-boxlite's native pid 1 knows x86_64 and aarch64 only (elsewhere the Python pid 1 runs)"
#endif

#define sys0(n) sys6((n), 0, 0, 0, 0, 0, 0)
#define sys1(n, a) sys6((n), (long)(a), 0, 0, 0, 0, 0)
#define sys2(n, a, b) sys6((n), (long)(a), (long)(b), 0, 0, 0, 0)
#define sys3(n, a, b, c) sys6((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define sys4(n, a, b, c, d) sys6((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define sys5(n, a, b, c, d, e) sys6((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), 0)

#define B_SIGKILL 9
#define B_SIGCHLD 17
#define B_SIG_BLOCK 0
#define B_SIG_SETMASK 2
#define B_EINTR 4
#define B_PR_SET_PDEATHSIG 1
#define B_PR_SET_DUMPABLE 4
#define B_F_SETFD 2
#define B_O_WRONLY 1
#define B_O_CLOEXEC 02000000
#define B_AT_EMPTY_PATH 0x1000
#define B_WNOHANG 1
#define B_CLOSE_RANGE_CLOEXEC 4

/* Decimal text of a non-negative number into buf (at least 21 bytes); returns buf. */
static inline char *b_utoa(unsigned long v, char *buf)
{
    char tmp[21];
    int n = 0, i = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        buf[i++] = tmp[--n];
    buf[i] = 0;
    return buf;
}

/* The number that decimal text s holds (-1: not a number). */
static inline long b_atol(const char *s)
{
    long v = 0;
    if (!s || !*s)
        return -1;
    if (*s == '-')
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

static inline unsigned long b_strlen(const char *s)
{
    unsigned long n = 0;
    while (s[n])
        n++;
    return n;
}

#endif
