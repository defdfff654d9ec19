import socket, sys, time, hashlib, os
def enc(args):
    out=[b'*%d\r\n'%len(args)]
    for a in args:
        if isinstance(a,str): a=a.encode()
        elif isinstance(a,int): a=str(a).encode()
        out.append(b'$%d\r\n'%len(a)+a+b'\r\n')
    return b''.join(out)
class R:
    def __init__(s,port):
        s.s=socket.create_connection(('127.0.0.1',port)); s.f=s.s.makefile('rb')
    def read(s):
        l=s.f.readline()
        t=l[:1]
        if t in b'+-:': return l[1:-2]
        if t==b'$':
            n=int(l[1:-2]); 
            if n<0: return None
            d=s.f.read(n+2); return d[:-2]
        if t==b'*':
            n=int(l[1:-2]); return [s.read() for _ in range(n)]
        raise Exception(l)
    def cmd(s,*a):
        s.s.sendall(enc(a)); return s.read()
    def pipe(s,cmds):
        s.s.sendall(b''.join(enc(c) for c in cmds)); return [s.read() for _ in cmds]
